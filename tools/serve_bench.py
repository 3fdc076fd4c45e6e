"""`specrun bench serve`: a load generator against a running `specrun serve` (or any
OpenAI-compatible server): Poisson arrivals at each given rate, or a fixed concurrency,
streamed chat completions, and per point the request throughput, output tokens/s, time to
first token and inter-token latency percentiles, and (from a specrun server's /metrics) the
mean accepted length and the share of busy wall time the device waited for the host.

Inter-token latency is per request: (last token time - first token time) / (tokens - 1), as
a client sees it (a speculative round delivers several tokens at once).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from ..runtime.distill.data import read_prompts


def register(subjects: argparse._SubParsersAction) -> None:
    parser = subjects.add_parser("serve", help="load a running `specrun serve` (HTTP)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument(
        "--rates", type=float, nargs="+", default=None,
        help="Poisson arrival rates in requests/s, one point each",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=None,
        help="fixed numbers of requests in flight, one point each (instead of --rates)",
    )  # fmt: skip
    parser.add_argument("--num-requests", type=int, default=64, help="requests per point")
    parser.add_argument("--prompts", default="builtin:heldout", help="JSONL or builtin:NAME")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--ignore-eos", action="store_true", help="every request runs max-tokens")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--label", default="", help="a name for the points (e.g. spec, plain)")
    parser.add_argument("--seed", type=int, default=0, help="arrival times and prompt order")
    parser.add_argument("--json", default=None, help="append one JSON line per point here")
    parser.add_argument("--plot", default=None, help="draw latency against rate into this PNG")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.rates is None) == (args.concurrency is None):
        raise ValueError("give --rates or --concurrency (one of them)")
    prompts = read_prompts(args.prompts)
    loads = [("rate", r) for r in args.rates or []] + [
        ("concurrency", c) for c in args.concurrency or []
    ]
    points = []
    for kind, value in loads:
        point = asyncio.run(_bench_point(args, prompts, kind, value))
        points.append(point)
        line = json.dumps(point)
        print(line, flush=True)
        if args.json:
            with open(args.json, "a") as sink:
                sink.write(line + "\n")
    print(format_table(points), file=sys.stderr)
    if args.plot:
        plot_points(points, Path(args.plot))
    return 0


async def _bench_point(args, prompts: list[str], kind: str, value: float) -> dict:
    rng = random.Random(args.seed)
    order = [prompts[rng.randrange(len(prompts))] for _ in range(args.num_requests)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = await _scrape(client)
        started = time.perf_counter()
        if kind == "rate":
            results = await _poisson(client, args, model, order, value, rng)
        else:
            results = await _closed_loop(client, args, model, order, int(value))
        seconds = time.perf_counter() - started
        after = await _scrape(client)
    return _summary(args, kind, value, results, seconds, before, after)


async def _poisson(client, args, model, order, rate, rng) -> list[dict]:
    tasks = []
    for prompt in order:
        tasks.append(asyncio.create_task(_one(client, args, model, prompt)))
        await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


async def _closed_loop(client, args, model, order, concurrency) -> list[dict]:
    queue = list(reversed(order))
    results: list[dict] = []

    async def worker():
        while queue:
            results.append(await _one(client, args, model, queue.pop()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def _one(client: httpx.AsyncClient, args, model: str, prompt: str | list[int]) -> dict:
    """One streamed request: text prompts as chat, token ids as a raw completion."""
    body = {
        "model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "ignore_eos": args.ignore_eos, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    if isinstance(prompt, str):
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        route, body["prompt"] = "/v1/completions", prompt
    sent = time.perf_counter()
    first = last = None
    num_tokens, status = 0, 0
    async with client.stream("POST", route, json=body) as reply:
        status = reply.status_code
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                num_tokens = chunk["usage"]["completion_tokens"]
            choice = chunk["choices"][0] if chunk["choices"] else {}
            if choice.get("text") or choice.get("delta", {}).get("content"):
                last = time.perf_counter()
                first = first or last
    return {"status": status, "sent": sent, "first": first, "last": last, "tokens": num_tokens}


async def _scrape(client: httpx.AsyncClient) -> dict[str, float]:
    try:
        text = (await client.get("/metrics")).text
    except httpx.HTTPError:
        return {}
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        return {"p50": values[0], "p90": values[0], "p99": values[0]}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": cuts[49], "p90": cuts[89], "p99": cuts[98]}


def _summary(args, kind, value, results, seconds, before, after) -> dict:
    done = [r for r in results if r["status"] == 200 and r["first"] is not None]
    ttft = [r["first"] - r["sent"] for r in done]
    itl = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in done)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    rounds = delta("specrun_accepted_length_count")
    active = delta("specrun_active_seconds_total")
    return {
        "label": args.label, kind: value, "num_requests": len(results),
        "num_failed": len(results) - len(done), "seconds": seconds,
        "requests_per_second": len(done) / seconds, "output_tokens_per_second": tokens / seconds,
        "ttft_s": _percentiles(ttft), "itl_s": _percentiles(itl),
        "mean_accepted_length": delta("specrun_accepted_length_sum") / rounds if rounds else None,
        "device_idle_share": 1 - delta("specrun_device_busy_seconds_total") / active
        if active else None,
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos,
        "temperature": args.temperature, "prompts": args.prompts,
    }  # fmt: skip


def format_table(points: list[dict]) -> str:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.1f}"

    lines = [
        f"{'label':>8} {'load':>10} {'req/s':>6} {'tok/s':>8} {'ttft50':>7} {'ttft99':>7} "
        f"{'itl50':>6} {'itl99':>6} {'accept':>6} {'idle':>5}"
    ]
    for p in points:
        load = f"{p['rate']}/s" if "rate" in p else f"c={p['concurrency']}"
        accept = p["mean_accepted_length"]
        idle = p["device_idle_share"]
        lines.append(
            f"{p['label']:>8} {load:>10} {p['requests_per_second']:>6.2f} "
            f"{p['output_tokens_per_second']:>8.1f} {ms(p['ttft_s']['p50']):>7} "
            f"{ms(p['ttft_s']['p99']):>7} {ms(p['itl_s']['p50']):>6} {ms(p['itl_s']['p99']):>6} "
            f"{'-' if accept is None else f'{accept:.2f}':>6} "
            f"{'-' if idle is None else f'{idle:.1%}':>5}"
        )
    return "\n".join(lines)


def plot_points(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (ttft_axes, itl_axes) = plt.subplots(1, 2, figsize=(10, 4))
    for label in dict.fromkeys(p["label"] for p in points):
        mine = [p for p in points if p["label"] == label and "rate" in p]
        rates = [p["rate"] for p in mine]
        ttft_axes.plot(rates, [p["ttft_s"]["p50"] for p in mine], marker="o", label=label)
        itl_axes.plot(rates, [p["itl_s"]["p50"] for p in mine], marker="o", label=label)
    for axes, name in ((ttft_axes, "time to first token p50 (s)"),
                       (itl_axes, "inter-token latency p50 (s)")):  # fmt: skip
        axes.set_xlabel("arrival rate (requests/s)")
        axes.set_ylabel(name)
        axes.legend()
    figure.tight_layout()
    figure.savefig(path)
