// AMX tile state the native kernels share (q8_linear.cc, lane_attention.cc): where the
// compiler targets the tile unit (-march=native on a CPU that has it), SLUICE_AMX is set;
// the OS must still grant the tile state (`amx_permitted`), and a kernel falls back to its
// AVX-512 path where it does not.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define SLUICE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace sluice {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The OS grants a process the tile state on request (Linux >= 5.16); asked once.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Every kernel's tiles are the same shape: all 8 of 16 rows x 64 bytes (bf16: 16 x 32;
// f32: 16 x 16). Set at the start of each work item (another kernel on this thread may
// have released them), `_tile_release()` at its end.
inline void tiles_on() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace sluice
#endif
