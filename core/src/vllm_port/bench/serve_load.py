"""``vllm-port bench serve-load``: many streaming clients against ``vllm-port serve``, some leaving mid-stream.

Starts a server (or uses ``--base-url``), runs every distinct prompt alone once for its greedy
reference, then ``--rounds`` rounds of ``--requests`` streaming completions from ``--concurrency``
clients, of which a ``--disconnect`` fraction close their stream after a few chunks. Checks, per
round: every completed stream well formed (chunks of one id, ``finish_reason`` on the last, the
usage chunk, ``data: [DONE]``) and equal to its reference; every disconnected request aborted (the
server's ``vllm_port:request_success{finished_reason="abort"}`` counts them); the KV pool back to
full (0 blocks leaked); ``/health`` answering throughout; and the server's RSS flat across rounds.
Prints a table, writes ``--json``; exit status 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LoadConfig", "RoundResult", "ServerProcess", "add_arguments", "run", "run_load", "start_server"]

#: Words the prompts are made of (the bundled model was trained on Austen).
_WORDS = (
    "the sea was calm and Elizabeth walked with her sister along the road to Longbourn while Mr Darcy said "
    "nothing of the letter which Jane had written in the morning before the ball at Netherfield"
).split()
#: Tokens a disconnecting request asks for: far more than it reads, so it is still running when it leaves.
_DISCONNECT_MAX_TOKENS = 400
#: RSS growth from the first round to the last that still counts as flat.
_RSS_SLACK = 0.05
_RSS_SLACK_BYTES = 32 << 20


@dataclass(frozen=True)
class LoadConfig:
    """One load run: ``requests`` streams per round from ``concurrency`` clients over ``prompts`` distinct prompts."""

    requests: int = 1000
    concurrency: int = 100
    disconnect: float = 0.2
    rounds: int = 3
    prompts: int = 64
    max_tokens: tuple[int, ...] = (8, 16, 32, 48)
    #: rounds run first and checked like the others, but not counted for the RSS check: they warm the
    #: allocator, the tokenizer's caches and the prefix cache up
    warmup_rounds: int = 1
    seed: int = 0


@dataclass
class RoundResult:
    """What one round saw."""

    round: int
    seconds: float = 0.0
    completed: int = 0
    disconnected: int = 0
    aborted: int = 0
    malformed: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    retried_503: int = 0
    connection_retries: int = 0
    errors: list[str] = field(default_factory=list)
    leaked_blocks: int = 0
    health_checks: int = 0
    health_failures: int = 0
    health_max_ms: float = 0.0
    rss_bytes: int = 0
    tokens: int = 0
    ttft_p50_ms: float = 0.0
    ttft_p99_ms: float = 0.0

    @property
    def ok(self) -> bool:
        return (
            not (self.malformed or self.mismatched or self.errors or self.leaked_blocks or self.health_failures)
            and self.aborted == self.disconnected
        )


# --- the server -----------------------------------------------------------------------------------


@dataclass
class ServerProcess:
    """A ``vllm-port serve`` subprocess on 127.0.0.1."""

    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def start_server(
    args: Sequence[str] = (), log: Path | None = None, timeout_s: float = 120.0, env: dict[str, str] | None = None
) -> Iterator[ServerProcess]:
    """Run ``vllm-port serve ARGS --port P`` until the block ends; yield it once ``/health`` answers 200.

    :raises RuntimeError: when the server exits or does not answer within ``timeout_s`` (its log attached).
    """
    import httpx

    port = free_port()
    log = log or Path(tempfile.gettempdir()) / f"vllm-port-serve-{port}.log"
    argv = [sys.executable, "-m", "vllm_port.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)  # noqa: S603 - our own CLI
    server = ServerProcess(process, port, log)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                why = (
                    f"exited {process.returncode}" if process.returncode is not None else f"no answer in {timeout_s} s"
                )
                raise RuntimeError(f"vllm-port serve {' '.join(args)}: {why}\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{server.base_url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def rss_bytes(pid: int) -> int:
    """A process's resident memory (Linux ``/proc``; 0 elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_metrics(text: str) -> dict[str, float]:
    """``/metrics`` as ``{sample name with labels: value}`` (``name{label="v"}`` for labelled samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


# --- the load -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    index: int
    prompt: str
    max_tokens: int
    disconnect_after: int  # chunks read before closing; 0: read to the end


def _prompts(config: LoadConfig) -> list[str]:
    rng = random.Random(config.seed)  # noqa: S311 - benchmark prompts, not secrets
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 24))) for _ in range(config.prompts)]


def _jobs(config: LoadConfig, prompts: list[str], round_index: int) -> list[_Job]:
    rng = random.Random(config.seed * 1000 + round_index)  # noqa: S311
    jobs = []
    for i in range(config.requests):
        leaves = rng.random() < config.disconnect
        tokens = _DISCONNECT_MAX_TOKENS if leaves else rng.choice(config.max_tokens)
        jobs.append(_Job(i, rng.choice(prompts), tokens, rng.randint(1, 3) if leaves else 0))
    return jobs


def _payload(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def check_stream(lines: list[str], max_tokens: int) -> tuple[str, str | None]:
    """The text of a complete stream of ``data:`` lines, and what is malformed about it (``None``: nothing)."""
    events = [line.removeprefix("data: ") for line in lines if line]
    if any(not line.startswith("data: ") for line in lines if line):
        return "", "a line that is not a 'data:' event"
    if not events or events[-1] != "[DONE]":
        return "", "no 'data: [DONE]' at the end"
    try:
        chunks = [json.loads(e) for e in events[:-1]]
    except json.JSONDecodeError as exc:
        return "", f"an event that is not JSON ({exc})"
    if not chunks or chunks[-1].get("choices") != [] or not chunks[-1].get("usage"):
        return "", "no usage chunk before [DONE]"
    body, usage = chunks[:-1], chunks[-1]["usage"]
    ids = {c.get("id") for c in chunks}
    if len(ids) != 1 or any(c.get("object") != "text_completion" for c in chunks):
        return "", f"chunks of ids {sorted(map(str, ids))[:3]} / objects {[c.get('object') for c in chunks][:3]}"
    finishes = [c["choices"][0]["finish_reason"] for c in body]
    if finishes[-1] != "length" or any(f is not None for f in finishes[:-1]):
        return "", f"finish reasons {finishes[-3:]} (want None..., 'length')"
    if usage["completion_tokens"] != max_tokens or usage["total_tokens"] != usage["prompt_tokens"] + max_tokens:
        return "", f"usage {usage} for max_tokens {max_tokens}"
    return "".join(c["choices"][0]["text"] for c in body), None


async def _one(client: Any, url: str, model: str, job: _Job, result: RoundResult, ttfts: list[float]) -> str | None:
    """Run one job; the text of a completed stream (``None`` for a disconnect).

    A connection that fails before any answer (a kept-alive one the server closed as it was reused)
    is counted and the request sent again, as an HTTP client's retry would; one that fails after
    the answer began is an error.
    """
    import httpx

    for attempt in range(3):
        try:
            return await _attempt(client, url, model, job, result, ttfts)
        except httpx.TransportError as exc:
            if getattr(exc, "answered", False) or attempt == 2:
                result.errors.append(f"request {job.index}: {type(exc).__name__}: {exc}")
                return None
            result.connection_retries += 1
    return None


async def _attempt(client: Any, url: str, model: str, job: _Job, result: RoundResult, ttfts: list[float]) -> str | None:
    while True:
        started = time.monotonic()
        async with client.stream("POST", url, json=_payload(model, job.prompt, job.max_tokens)) as response:
            if response.status_code == 503:  # full: wait as asked, then retry
                result.retried_503 += 1
                await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                continue
            if response.status_code != 200:
                result.errors.append(
                    f"request {job.index}: HTTP {response.status_code} {(await response.aread())[:200]!r}"
                )
                return None
            lines, chunks = [], 0
            try:
                async for line in response.aiter_lines():
                    if line and not lines:
                        ttfts.append(time.monotonic() - started)
                    lines.append(line)
                    chunks += bool(line)
                    if job.disconnect_after and chunks >= job.disconnect_after:
                        result.disconnected += 1
                        return None  # leaving the block closes the connection mid-stream
            except Exception as exc:
                exc.answered = True  # type: ignore[attr-defined]  # not retried: the stream had begun
                raise
        text, problem = check_stream(lines, job.max_tokens)
        if problem:
            result.malformed.append(f"request {job.index}: {problem}")
            return None
        result.completed += 1
        result.tokens += job.max_tokens
        return text


def _poll_health(base_url: str, stop: Any, out: Any) -> None:
    """Ask ``/health`` every 0.2 s until ``stop`` is set; put ``(checks, failures, slowest ms)`` on ``out``.

    In a process of its own: the load's clients keep this process's event loop busy, and a poller
    sharing it would time its own lag, not the server's.
    """
    import urllib.request

    checks = failures = 0
    slowest = 0.0
    while not stop.is_set():
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=10) as response:  # noqa: S310 - our server
                ok = response.status == 200
        except OSError:
            ok = False
        checks, failures = checks + 1, failures + (not ok)
        slowest = max(slowest, 1000 * (time.monotonic() - started))
        stop.wait(0.2)
    out.put((checks, failures, slowest))


async def _settled_metrics(client: Any, base_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """``/metrics`` once nothing runs or waits and the pool is back to full (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics((await client.get(f"{base_url}/metrics")).text)
        idle = not metrics["vllm_port:num_requests_running"] and not metrics["vllm_port:num_requests_waiting"]
        full = metrics["vllm_port:kv_cache_free_blocks"] == metrics["vllm_port:kv_cache_total_blocks"]
        if (idle and full) or time.monotonic() > deadline:
            return metrics
        await asyncio.sleep(0.1)


def _aborts(metrics: dict[str, float]) -> int:
    return int(metrics.get('vllm_port:request_success_total{finished_reason="abort"}', 0))


async def _references(base_url: str, model: str, jobs: list[_Job]) -> dict[tuple[str, int], str]:
    """Each distinct (prompt, max_tokens) of the completing jobs, run alone (one request at a time)."""
    import httpx

    wanted = sorted({(j.prompt, j.max_tokens) for j in jobs if not j.disconnect_after})
    out = {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        for prompt, max_tokens in wanted:
            payload = {**_payload(model, prompt, max_tokens), "stream": False}
            del payload["stream_options"]
            response = await client.post(f"{base_url}/v1/completions", json=payload)
            response.raise_for_status()
            out[(prompt, max_tokens)] = response.json()["choices"][0]["text"]
    return out


async def _round(
    base_url: str,
    pid: int | None,
    model: str,
    jobs: list[_Job],
    references: dict[tuple[str, int], str],
    index: int,
    concurrency: int,
) -> RoundResult:
    import httpx

    result = RoundResult(index)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        before = _aborts(await _settled_metrics(client, base_url))
        pending = iter(jobs)
        ttfts: list[float] = []
        url = f"{base_url}/v1/completions"

        async def worker() -> None:
            for job in pending:
                text = await _one(client, url, model, job, result, ttfts)
                if text is not None and text != references[(job.prompt, job.max_tokens)]:
                    result.mismatched.append(
                        f"request {job.index}: {text[:40]!r} != {references[(job.prompt, job.max_tokens)][:40]!r}"
                    )

        spawn = multiprocessing.get_context("spawn")
        stop, health_out = spawn.Event(), spawn.Queue()
        health = spawn.Process(target=_poll_health, args=(base_url, stop, health_out), daemon=True)
        health.start()
        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.seconds = time.monotonic() - started
        settled = await _settled_metrics(client, base_url)
        stop.set()
        result.health_checks, result.health_failures, result.health_max_ms = health_out.get(timeout=30)
        health.join()
    result.aborted = _aborts(settled) - before
    result.leaked_blocks = int(settled["vllm_port:kv_cache_total_blocks"] - settled["vllm_port:kv_cache_free_blocks"])
    result.rss_bytes = rss_bytes(pid) if pid else 0
    ttfts.sort()
    if ttfts:
        result.ttft_p50_ms = 1000 * ttfts[len(ttfts) // 2]
        result.ttft_p99_ms = 1000 * ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))]
    return result


def run_load(base_url: str, pid: int | None, config: LoadConfig, model: str = "bundled") -> dict[str, Any]:
    """Every round of ``config`` against the server at ``base_url`` (``pid``: for its RSS); the report."""
    prompts = _prompts(config)
    jobs = [_jobs(config, prompts, i) for i in range(config.warmup_rounds + config.rounds)]
    references = asyncio.run(_references(base_url, model, [j for round_jobs in jobs for j in round_jobs]))
    rounds = [
        asyncio.run(_round(base_url, pid, model, round_jobs, references, i, config.concurrency))
        for i, round_jobs in enumerate(jobs)
    ]
    measured = rounds[config.warmup_rounds :]
    first, last = measured[0].rss_bytes, measured[-1].rss_bytes
    rss_flat = not pid or last <= first * (1 + _RSS_SLACK) + _RSS_SLACK_BYTES
    return {
        "config": asdict(config),
        "rounds": [{**asdict(r), "ok": r.ok, "warmup": r.round < config.warmup_rounds} for r in rounds],
        "rss_flat": rss_flat,
        "ok": rss_flat and all(r.ok for r in rounds),
    }


def format_table(report: dict[str, Any]) -> str:
    head = (
        f"{'round':>5} {'s':>6} {'done':>5} {'left':>5} {'aborted':>7} {'tok/s':>7} {'TTFT p50':>9} {'p99 ms':>7} "
        f"{'leaked':>6} {'bad':>4} {'503s':>5} {'reconn':>6} {'health':>11} {'max ms':>7} {'RSS MiB':>8}"
    )
    lines = [head]
    for r in report["rounds"]:
        bad = len(r["malformed"]) + len(r["mismatched"]) + len(r["errors"])
        health = f"{r['health_checks'] - r['health_failures']}/{r['health_checks']}"
        lines.append(
            f"{('w' if r['warmup'] else '') + str(r['round']):>5} {r['seconds']:>6.1f} {r['completed']:>5} {r['disconnected']:>5} {r['aborted']:>7} "
            f"{r['tokens'] / max(r['seconds'], 1e-9):>7.0f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p99_ms']:>7.1f} "
            f"{r['leaked_blocks']:>6} {bad:>4} {r['retried_503']:>5} {r['connection_retries']:>6} {health:>11} "
            f"{r['health_max_ms']:>7.0f} {r['rss_bytes'] / 2**20:>8.1f}"
        )
    lines.append(
        f"RSS flat over the rounds after warm-up (w): {report['rss_flat']}; all checks: "
        f"{'PASS' if report['ok'] else 'FAIL'}"
    )
    return "\n".join(lines)


def add_arguments(parser: Any) -> None:
    """The options of ``vllm-port bench serve-load``."""
    parser.add_argument("--requests", type=int, default=1000, help="streaming requests per round (default 1000)")
    parser.add_argument("--concurrency", type=int, default=100, help="concurrent clients (default 100)")
    parser.add_argument("--disconnect", type=float, default=0.2, help="fraction that leave mid-stream (default 0.2)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, for the RSS check (default 3)")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds before them, not in the RSS check")
    parser.add_argument("--base-url", default=None, help="use this server instead of starting one")
    parser.add_argument("--model", default=None, metavar="DIR", help="model directory to serve (default: bundled)")
    parser.add_argument("--device", default="cpu", help="the started server's platform (default cpu)")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="the started server's --max-num-seqs")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the report to this JSON file")


def run(args: Any) -> int:
    """Run ``vllm-port bench serve-load``; exit status 0 when every check passed."""
    config = LoadConfig(args.requests, args.concurrency, args.disconnect, args.rounds, warmup_rounds=args.warmup_rounds)
    model = args.model or "bundled"  # the name the started server answers to
    if args.base_url:
        report = run_load(args.base_url.rstrip("/"), None, config, model)
    else:
        serve_args = [*([args.model] if args.model else []), "--device", args.device]
        serve_args += ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.concurrency), "--seed", "0"]
        with start_server(serve_args) as server:
            report = run_load(server.base_url, server.pid, config, model)
    report["load_average"] = os.getloadavg()
    print(format_table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1
