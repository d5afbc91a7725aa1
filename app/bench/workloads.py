"""Deterministic request streams: what each workload sends.

Request ``i`` of a workload depends only on (seed, i) and the calibration, never on the
order in which requests are made, so a closed loop, an open loop and a sweep that starts
at another index all send the same request ``i``. Python's `random.Random` seeded with a
string hashes it with SHA-512, so this holds across processes and PYTHONHASHSEED.

Lengths are asked for in tokens, but the target may be any server with any tokenizer, so
text is built from an English word list and measured in words: `words_per_token`
converts (0.75 words a token is typical of BPE on English). `calibrate` measures the
real ratio with the server's ``POST /tokenize`` when it has one (Sluice and vLLM do);
without it, or with ``--no-calibrate``, 0.75 is used and the prompts are identical for
every target. The chat template adds a few tokens on top; the usage of every response
reports the true prompt length, which is what the statistics use.
"""

from __future__ import annotations

import dataclasses
import inspect
import random
from dataclasses import dataclass
from typing import Callable

import httpx

DEFAULT_WORDS_PER_TOKEN = 0.75
NAMES = ("shared-prefix", "mixed", "long-interference", "overload")

# Common English words, function words repeated so that frequencies look roughly natural.
_FUNCTION = ("the the the the a a an of of of to to to and and and in in is is that it "
             "for on with as was be by this are or from at have not but which can all "
             "their will one has more when there also been into other some these than")
_CONTENT = """
time year people way day man thing woman life child world school state family student
group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot
right study book eye job word business issue side kind head house service friend father
power hour game line end member law car city community name president team minute idea
kid body information back parent face others level office door health person art war
history party result change morning reason research girl guy moment air teacher force
education river market bridge engine winter summer letter window table garden
mountain valley forest ocean island village harbor station library museum theater
make go know take see come think look want give use find tell ask seem feel try leave
call keep begin help show hear play run move like live believe hold bring happen write
provide sit stand lose pay meet include continue set learn lead understand watch follow
stop create speak read allow add spend grow open walk win offer remember love consider
appear buy wait serve die send expect build stay fall cut reach kill remain suggest
raise pass sell require report decide pull explain carry develop hope drive return
good new first last long great little own old big high different small large next early
young important few public bad same able late hard major better economic strong possible
whole free military true federal international full special easy clear recent certain
personal open red difficult available likely short single medical current wrong private
past foreign fine common poor natural significant similar hot dead central happy serious
ready simple left physical general environmental financial blue democratic dark various
quickly slowly often always never sometimes usually really almost together already
"""
WORDS = tuple(_FUNCTION.split()) + tuple(_CONTENT.split())


def words(rng: random.Random, n: int, *, end: str = ".") -> str:
    """``n`` words of sentence-like text (capitalised, 5-16 word sentences)."""
    out: list[str] = []
    sentence_left = 0
    for k in range(n):
        w = rng.choice(WORDS)
        if sentence_left == 0:
            if out:
                out[-1] += "."
            w = w.capitalize()
            sentence_left = rng.randint(5, 16)
        elif sentence_left > 3 and rng.random() < 0.06:
            out[-1] += ","
        out.append(w)
        sentence_left -= 1
    return " ".join(out) + (end if out else "")


@dataclass(frozen=True)
class RequestSpec:
    """One chat request: its messages, its answer cap, and the prompt length aimed at."""

    messages: tuple[tuple[str, str], ...]  # (role, content)
    max_tokens: int
    prompt_tokens: int  # target, in the server's tokens by the calibration
    tag: str = "main"  # "short" and "long" in long-interference
    model: str | None = None  # overrides the run's model (--adapters: an adapter's name)

    def body(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.messages]


class Workload:
    """Base: turns token targets into word counts and seeds one RNG per request."""

    name = ""

    def __init__(self, seed: int, words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
                 max_tokens: int | None = None) -> None:
        self.seed = seed
        self.words_per_token = words_per_token
        self.fixed_max_tokens = max_tokens  # --max-tokens overrides the workload's range

    def rng(self, *key: object) -> random.Random:
        return random.Random(":".join(map(str, (self.name, self.seed, *key))))

    def n_words(self, tokens: int) -> int:
        return max(1, round(tokens * self.words_per_token))

    def answer(self, rng: random.Random, lo: int, hi: int) -> int:
        drawn = rng.randint(lo, hi)  # always drawn, so --max-tokens leaves prompts alone
        return self.fixed_max_tokens or drawn

    def request(self, i: int) -> RequestSpec:
        raise NotImplementedError


class SharedPrefix(Workload):
    """The typical customer: one long system prompt, then a short distinct question."""

    name = "shared-prefix"

    def __init__(self, seed: int, words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
                 max_tokens: int | None = None, *, system_tokens: int = 2000,
                 question_tokens: tuple[int, int] = (30, 100),
                 answer_tokens: tuple[int, int] = (128, 400)) -> None:
        super().__init__(seed, words_per_token, max_tokens)
        self.question_tokens, self.answer_tokens = question_tokens, answer_tokens
        self.system_tokens = system_tokens
        rng = self.rng("system")
        self.system = ("You are the assistant of a travel and history company. Answer from "
                       "these notes. " + words(rng, self.n_words(system_tokens)))

    def request(self, i: int) -> RequestSpec:
        rng = self.rng("request", i)
        q = rng.randint(*self.question_tokens)
        question = f"Question {i}: " + words(rng, self.n_words(q), end="?")
        return RequestSpec((("system", self.system), ("user", question)),
                           self.answer(rng, *self.answer_tokens), self.system_tokens + q)


class Mixed(Workload):
    """No shared prefix: every prompt is its own, 100-1,500 tokens."""

    name = "mixed"

    def __init__(self, seed: int, words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
                 max_tokens: int | None = None, *,
                 prompt_tokens: tuple[int, int] = (100, 1500),
                 answer_tokens: tuple[int, int] = (64, 256)) -> None:
        super().__init__(seed, words_per_token, max_tokens)
        self.prompt_tokens, self.answer_tokens = prompt_tokens, answer_tokens

    def request(self, i: int) -> RequestSpec:
        rng = self.rng("request", i)
        p = rng.randint(*self.prompt_tokens)
        text = f"Request {i}. Summarise this: " + words(rng, self.n_words(p))
        return RequestSpec((("user", text),), self.answer(rng, *self.answer_tokens), p)


class LongInterference(Workload):
    """Short streams (`request`) and the one long prompt (`long`) that interrupts them."""

    name = "long-interference"

    def __init__(self, seed: int, words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
                 max_tokens: int | None = None, *, long_prompt_tokens: int = 6000,
                 long_max_tokens: int = 16, short_prompt_tokens: tuple[int, int] = (30, 100),
                 short_answer_tokens: tuple[int, int] = (128, 256)) -> None:
        super().__init__(seed, words_per_token, max_tokens)
        self.long_prompt_tokens, self.long_max_tokens = long_prompt_tokens, long_max_tokens
        self.short_prompt_tokens = short_prompt_tokens
        self.short_answer_tokens = short_answer_tokens

    def request(self, i: int) -> RequestSpec:
        rng = self.rng("short", i)
        p = rng.randint(*self.short_prompt_tokens)
        text = f"Stream {i}: " + words(rng, self.n_words(p), end="?")
        return RequestSpec((("user", text),), self.answer(rng, *self.short_answer_tokens), p,
                           tag="short")

    def long(self) -> RequestSpec:
        rng = self.rng("long")
        text = "Read this report, then name its main point. " + words(
            rng, self.n_words(self.long_prompt_tokens))
        return RequestSpec((("user", text),), self.long_max_tokens, self.long_prompt_tokens,
                           tag="long")


class Overload(SharedPrefix):
    """The shared-prefix customer, sent faster than the server can serve it."""

    name = "overload"


def make_workload(name: str, seed: int, words_per_token: float = DEFAULT_WORDS_PER_TOKEN,
                  max_tokens: int | None = None, **kw: object) -> Workload:
    """The workload called ``name``; ``kw`` takes only the options that it knows."""
    cls = {"shared-prefix": SharedPrefix, "mixed": Mixed,
           "long-interference": LongInterference, "overload": Overload}[name]
    known = inspect.signature(cls.__init__).parameters
    return cls(seed, words_per_token, max_tokens,  # type: ignore[arg-type]
               **{k: v for k, v in kw.items() if k in known and v is not None})


async def calibrate(http: httpx.AsyncClient, model: str | None, seed: int = 0
                    ) -> float | None:
    """Words per token of the server's tokenizer on our text, or None without /tokenize.

    Sluice answers ``{"count": n, ...}``, vLLM ``{"count": n, "tokens": [...]}``.
    """
    sample = words(random.Random(f"calibration:{seed}"), 1500)
    body: dict[str, object] = {"prompt": sample}
    if model:
        body["model"] = model
    try:
        r = await http.post("/tokenize", json=body)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        data = r.json()
        count = data.get("count") or len(data.get("tokens") or ())
    except (ValueError, AttributeError):
        return None
    if not count:
        return None
    ratio = len(sample.split()) / count
    return ratio if 0.1 <= ratio <= 3.0 else None  # anything else is not a tokenizer


class AdapterMix:
    """`--adapters N`: each request asks for one of N adapters by name (`model`), picked
    from the request's index and the seed, uniformly or Zipf-distributed (adapter k is
    asked for in proportion to 1 / (k + 1): a few popular fine-tunes and a long tail)."""

    def __init__(self, names: list[str], dist: str, seed: int) -> None:
        self.names, self.dist, self.seed = names, dist, seed
        n = len(names)
        self.weights = [1.0 / (k + 1) for k in range(n)] if dist == "zipf" else [1.0] * n

    def pick(self, index: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + index)
        return rng.choices(self.names, weights=self.weights)[0]

    def wrap(self, spec_of: Callable[[int], RequestSpec], *, round_robin: bool = False
             ) -> Callable[[int], RequestSpec]:
        """Requests naming their adapter; `round_robin` (the warm-up) visits every
        adapter in turn, so each one's copy of a shared prefix is cached before measuring."""
        if round_robin:
            return lambda i: dataclasses.replace(
                spec_of(i), model=self.names[i % len(self.names)])
        return lambda i: dataclasses.replace(spec_of(i), model=self.pick(i))
