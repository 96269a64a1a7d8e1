"""serve_bench's report: the markdown tables, the JSON and the plot of a run.

The trade-off table puts every mode's output tok/s side by side per load, with
the ratios the benchmark exists for: `on / off` and `auto / best of off, on`
(speculation against plain decoding), and with a peer (`benchmarks.peers`)
`off / peer` (plain decoding against the peer's) and, beside n-gram peers,
`auto / best peer n-gram` and `on / best peer n-gram`; with both a plain and
an n-gram peer, `auto / peer plain` (a peer whose speculation cannot turn
itself off per request against one that never speculates); and per peer engine
`specd best / ENGINE best`: specd's fastest mode over that engine's fastest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from scheduler.types import PLAIN_REASONS

MODES = ("off", "on", "auto")


def ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def is_ngram_peer(mode: str) -> bool:
    """A peer mode that speculates (vLLM's n-gram, llama.cpp's prompt lookup)."""
    return "-ngram-" in mode or "-lookup-" in mode


def peer_engine(mode: str) -> str:
    """The engine a peer mode runs ("vllm-ngram-k5" -> "vllm")."""
    return mode.split("-", 1)[0]


def peer_modes(runs: list[dict]) -> list[str]:
    """The peers' modes in the order they first appear."""
    return list(dict.fromkeys(r["mode"] for r in runs if r["mode"] not in MODES))


def percentiles(values: list[float], scale: float = 1e3) -> dict[str, float] | None:
    """mean, p50, p95, p99 (linear interpolation), times `scale` (seconds -> ms)."""
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        pos = (len(ordered) - 1) * q
        low = math.floor(pos)
        high = min(low + 1, len(ordered) - 1)
        return (ordered[low] + (ordered[high] - ordered[low]) * (pos - low)) * scale

    return {"mean": sum(ordered) / len(ordered) * scale, "p50": at(0.5), "p95": at(0.95), "p99": at(0.99)}


def summarize(mode: str, load, results: list, seconds: float, delta: dict, args: argparse.Namespace) -> dict:
    """One mode at one load: `results` of every repeat, their `seconds` and server counter deltas added up."""
    done = [r for r in results if r.ok]
    ttft, tpot, e2e, itl, chunk_itl = [], [], [], [], []
    for r in done:
        if not r.chunk_times:
            continue
        ttft.append(r.chunk_times[0] - r.start)
        e2e.append(r.end - r.start)
        if r.num_output_tokens > 1:
            tpot.append((r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output_tokens - 1))
        for prev, now, num_tokens in zip(r.chunk_times, r.chunk_times[1:], r.chunk_tokens[1:]):
            chunk_itl.append(now - prev)
            itl += [(now - prev) / num_tokens] * num_tokens
    num_steps = delta["steps_spec"] + delta["steps_plain"]
    accepted_per_draft = ratio(delta["num_accepted_tokens"], delta["num_drafts"])
    num_accepted = sum(r.num_accepted for r in done)
    num_output = sum(r.num_output_tokens for r in results)
    errors = [r.error for r in results if r.error]
    return {
        "mode": mode,
        "load_kind": load.kind,
        "load": load.value if math.isfinite(load.value) else "inf",
        "num_requests": len(results),
        "num_completed": len(done),
        "num_failed": sum(1 for e in errors if not e.startswith("cancelled")),
        "num_cancelled": sum(1 for e in errors if e.startswith("cancelled")),
        # Short of max_tokens: a fault with fixed lengths, the point of natural ones.
        "num_short": sum(1 for r in done if r.num_output_tokens != r.max_tokens) if args.lengths == "fixed" else 0,
        "errors": sorted(set(errors))[:5],
        "duration_s": seconds,
        "total_output_tokens": num_output,
        "request_throughput": len(done) / seconds,
        "output_throughput": num_output / seconds,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "chunk_itl_ms": percentiles(chunk_itl),
        "e2e_ms": percentiles(e2e),
        "acceptance_rate": ratio(delta["num_accepted_tokens"], delta["num_draft_tokens"]),
        "mean_acceptance_length": None if accepted_per_draft is None else 1 + accepted_per_draft,
        "spec_step_share": ratio(delta["steps_spec"], num_steps),
        "engine_steps": num_steps,
        # The engine's own time per step (its forwards, not HTTP): two runs of the same step
        # shapes that differ here differ in the machine's speed, not in what the policy chose.
        "step_ms": ratio(delta["cost_observed_seconds"] * 1e3, num_steps),
        # A closed loop of equal-length requests keeps `off` in lock step (every slot busy to
        # the end); a mode that finishes some requests early leaves slots idle in the tail.
        "mean_batch_rows": ratio(delta["batch_rows"], delta["batch_steps"]),
        # Summed over the run's steps: 1.0 is a cost model that predicted the run's time exactly.
        "step_time_predicted_over_measured": ratio(delta["cost_predicted_seconds"], delta["cost_observed_seconds"]),
        "acceptance_rate_usage": ratio(num_accepted, num_accepted + sum(r.num_rejected for r in done)),
        "tokens_per_chunk": ratio(sum(sum(r.chunk_tokens) for r in done), sum(len(r.chunk_tokens) for r in done)),
        # Steps whose speculation-auto rows ran plain, by the policy's reason (PLAIN_REASONS).
        "plain_steps_by_reason": {r: delta[f"plain_{r}"] for r in PLAIN_REASONS if f"plain_{r}" in delta},
        "server_counters": dict(delta),
        "loadavg_1m": os.getloadavg()[0],
    }


def load_label(run: dict) -> str:
    label = f"c={run['load']}" if run["load_kind"] == "concurrency" else f"{run['load']} req/s"
    return label + (f" pass {run['pass']}" if run.get("pass", 1) > 1 else "")


def fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def pct(stats: dict | None, key: str, scale: float = 1.0, digits: int = 1) -> str:
    return fmt(stats[key] * scale, digits) if stats else "-"


def share(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def tradeoff(runs: list[dict]) -> dict:
    """Per load: output tok/s by mode and the ratios (module docstring); the crossover concurrency."""
    by_load: dict[tuple, dict[str, dict]] = {}
    for run in runs:
        by_load.setdefault((run["load_kind"], run["load"]), {})[run["mode"]] = run
    rows = []
    for (kind, load), modes in by_load.items():
        tps = {mode: run["output_throughput"] for mode, run in modes.items()}
        best = max(tps.get("off", 0.0), tps.get("on", 0.0))
        specd_best = max((tps[m] for m in MODES if m in tps), default=0.0)
        engines = dict.fromkeys(peer_engine(m) for m in tps if m not in MODES)
        # The plain/n-gram peer columns name one peer: with several engines, only best against best.
        single = len(engines) == 1
        plain_peer = next((tps[m] for m in tps if m not in MODES and not is_ngram_peer(m)), None) if single else None
        ngram_peer = max((tps[m] for m in tps if is_ngram_peer(m)), default=None) if single else None
        best_vs = {f"best_vs_{engine}": ratio(specd_best, max(v for m, v in tps.items()
                                                              if m not in MODES and peer_engine(m) == engine))
                   for engine in engines}  # fmt: skip
        rows.append({"load_kind": kind, "load": load, "output_throughput": tps, **best_vs,
                     "off_vs_peer": ratio(tps["off"], plain_peer) if "off" in tps and plain_peer else None,
                     "auto_vs_peer_ngram": ratio(tps["auto"], ngram_peer) if "auto" in tps and ngram_peer else None,
                     "on_vs_peer_ngram": ratio(tps["on"], ngram_peer) if "on" in tps and ngram_peer else None,
                     "auto_vs_peer": ratio(tps["auto"], plain_peer) if "auto" in tps and plain_peer else None,
                     "on_vs_off": ratio(tps.get("on", 0.0), tps.get("off", 0.0)) if "on" in tps else None,
                     "auto_vs_best": ratio(tps["auto"], best) if "auto" in tps and best else None})  # fmt: skip
    levels = [r for r in rows if r["load_kind"] == "concurrency" and r["on_vs_off"] is not None]
    crossover = None  # lowest concurrency from which speculation (on) never beats off again
    for row in reversed(levels):
        if row["on_vs_off"] >= 1.0:
            break
        crossover = row["load"]
    worst = min((r for r in rows if r["auto_vs_best"] is not None), key=lambda r: r["auto_vs_best"], default=None)
    return {"rows": rows, "crossover_concurrency": crossover, "on_always_faster": bool(levels) and crossover is None,
            "worst_auto_vs_best": worst and {"load_kind": worst["load_kind"], "load": worst["load"],
                                             "auto_vs_best": worst["auto_vs_best"]}}  # fmt: skip


def markdown(report: dict) -> str:
    meta, runs = report["meta"], report["runs"]
    spec = meta["speculation"]
    text = [
        "## specd serving benchmark\n",
        f"`{meta['model']}`, proposer {spec.get('proposer')}, K={spec.get('num_speculative_tokens')}, "
        f"spec-disable-batch-size {spec.get('spec_disable_batch_size')}; prompts {'+'.join(meta['prompt_sets'])}; "
        f"{length_label(meta)} per request (greedy); {meta['machine']}, {meta['date']}.\n",
    ]
    for mode, label in (meta.get("peers") or {}).items():
        text.append(f"Peer `{mode}`: {label}, on the model specd serves, with the same max-model-len.\n")
    rows = [[r["mode"], load_label(r), f"{r['num_completed']}/{r['num_requests']}", fmt(r["request_throughput"], 2),
             fmt(r["output_throughput"]), pct(r["ttft_ms"], "p50"), pct(r["tpot_ms"], "p50"), pct(r["itl_ms"], "p50"),
             pct(r["e2e_ms"], "p50", 1e-3, 2), share(r["acceptance_rate"]), fmt(r["mean_acceptance_length"], 2),
             share(r["spec_step_share"]), fmt(r.get("mean_batch_rows"), 1), fmt(r.get("engine_steps"), 0),
             fmt(r.get("step_ms"), 1)] for r in runs]  # fmt: skip
    text.append(md_table(["mode", "load", "done", "req/s", "out tok/s", "TTFT p50 ms", "TPOT p50 ms", "ITL p50 ms",
                          "e2e p50 s", "accept", "accept len", "spec steps", "rows/step", "steps",
                          "ms / step"], rows))  # fmt: skip

    def three(stats: dict | None, scale: float = 1.0, digits: int = 1) -> str:
        return " / ".join(pct(stats, q, scale, digits) for q in ("p50", "p95", "p99"))

    rows = [[r["mode"], load_label(r), three(r["ttft_ms"]), three(r["tpot_ms"]), three(r["itl_ms"]),
             three(r["e2e_ms"], 1e-3, 2)] for r in runs]  # fmt: skip
    text += ["\n### Latency p50 / p95 / p99\n",
             md_table(["mode", "load", "TTFT ms", "TPOT ms", "ITL ms", "e2e s"], rows)]  # fmt: skip
    text += tradeoff_markdown(report["tradeoff"])
    text += plain_reasons_markdown(runs)
    failed = [r for r in runs if r["num_failed"] or r["num_cancelled"] or r["num_short"]]
    for r in failed:
        text.append(f"\n{r['mode']} {load_label(r)}: {r['num_failed']} failed, {r['num_cancelled']} cancelled at the "
                    f"time limit, {r['num_short']} short of max_tokens; {'; '.join(r['errors'])}")  # fmt: skip
    return "\n".join(text) + "\n"


def plain_reasons_markdown(runs: list[dict]) -> list[str]:
    """Where `auto` ran plain, by the policy's reason, for the runs that counted any."""
    runs = [r for r in runs if any(r.get("plain_steps_by_reason", {}).values())]
    if not runs:
        return []
    rows = [[r["mode"], load_label(r), fmt(r.get("engine_steps"), 0), share(r["spec_step_share"]),
             *(fmt(r["plain_steps_by_reason"].get(reason), 0) for reason in PLAIN_REASONS)]
            for r in runs]  # fmt: skip
    return ["\n### Why `auto` rows ran plain (steps)\n",
            md_table(["mode", "load", "steps", "spec steps", *PLAIN_REASONS], rows)]  # fmt: skip


RATIO_COLUMNS = {  # key in a tradeoff row -> column title
    "on_vs_off": "on / off",
    "auto_vs_best": "auto / best of off, on",
    "off_vs_peer": "off / peer",
    "auto_vs_peer": "auto / peer",
    "on_vs_peer_ngram": "on / best peer n-gram",
    "auto_vs_peer_ngram": "auto / best peer n-gram",
}


def tradeoff_markdown(summary: dict) -> list[str]:
    rows_in = summary["rows"]
    modes = list(dict.fromkeys(m for r in rows_in for m in r["output_throughput"]))
    modes = [m for m in MODES if m in modes] + [m for m in modes if m not in MODES]
    columns = [key for key in RATIO_COLUMNS if any(r.get(key) is not None for r in rows_in)]
    engines = list(dict.fromkeys(key for r in rows_in for key in r if key.startswith("best_vs_")))
    titles = {**RATIO_COLUMNS, **{key: f"specd best / {key.removeprefix('best_vs_')} best" for key in engines}}
    columns += engines
    rows = [[f"c={r['load']}" if r["load_kind"] == "concurrency" else f"{r['load']} req/s",
             *(fmt(r["output_throughput"].get(m)) for m in modes), *(fmt(r.get(key), 2) for key in columns)]
            for r in rows_in]  # fmt: skip
    text = ["\n### Speculation trade-off (output tok/s)\n",
            md_table(["load", *modes, *(titles[key] for key in columns)], rows), ""]  # fmt: skip
    if summary["crossover_concurrency"] is not None:
        level = summary["crossover_concurrency"]
        text.append(f"Speculation stops paying from concurrency {level} (on < off there and above).")
    elif summary["on_always_faster"]:
        text.append("Speculation (on) beat off at every concurrency measured.")
    worst = summary["worst_auto_vs_best"]
    if worst:
        verdict = "within 3% of" if worst["auto_vs_best"] >= 0.97 else "more than 3% below"
        text.append(f"Auto's worst load: {worst['load_kind']} {worst['load']}, {worst['auto_vs_best']:.2f} of the "
                    f"better of off/on ({verdict} it).")  # fmt: skip
    return text


def length_label(meta: dict) -> str:
    ratio = meta.get("length_range_ratio") or 0.0
    tokens = (
        f"{meta['max_tokens']} x [{1 - ratio:g}, {1 + ratio:g}] tokens" if ratio else f"{meta['max_tokens']} tokens"
    )
    if meta.get("lengths", "fixed") == "fixed":
        return f"{tokens} (ignore_eos)"
    return f"up to {tokens} (to end of sequence)"


def plot_title(meta: dict) -> str:
    spec = meta["speculation"]
    return (
        f"{meta['model']} ({spec.get('proposer')}, K={spec.get('num_speculative_tokens')}, auto threshold "
        f"{spec.get('spec_disable_batch_size')}), {length_label(meta)}/request, {meta['machine']}"
    )


def progress_line(run: dict) -> str:
    return (f"{run['mode']:>4} {load_label(run):>10}: {run['num_completed']}/{run['num_requests']} done in "
            f"{run['duration_s']:.1f}s, {run['output_throughput']:.1f} tok/s, "
            f"TPOT p50 {pct(run['tpot_ms'], 'p50')} ms, acceptance {share(run['acceptance_rate'])}, "
            f"spec steps {share(run['spec_step_share'])}")  # fmt: skip


def plot(runs: list[dict], title: str, path: Path) -> bool:
    """Output tok/s and p50 TPOT vs load, one line per mode; one row per load kind. False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = [k for k in ("concurrency", "rate") if any(r["load_kind"] == k for r in runs)]
    fig, axes = plt.subplots(len(kinds), 2, figsize=(11, 4 * len(kinds)), squeeze=False)
    for row, kind in zip(axes, kinds):
        for mode in [*MODES, *peer_modes(runs)]:
            points = [r for r in runs if r["load_kind"] == kind and r["mode"] == mode and r["load"] != "inf"]
            if not points:
                continue
            xs = [r["load"] for r in points]
            row[0].plot(xs, [r["output_throughput"] for r in points], marker="o", label=mode)
            tpots = [r["tpot_ms"]["p50"] if r["tpot_ms"] else float("nan") for r in points]
            row[1].plot(xs, tpots, marker="o", label=mode)
        levels = sorted({r["load"] for r in runs if r["load_kind"] == kind and r["load"] != "inf"})
        for ax, ylabel in zip(row, ("output tokens/s", "TPOT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [f"{x:g}" for x in levels])
            ax.minorticks_off()
            ax.set_xlabel("concurrent requests" if kind == "concurrency" else "request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
            ax.legend(title="mode")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_report(out_dir: Path, meta: dict, runs: list[dict]) -> str:
    report = {"meta": meta, "runs": runs, "tradeoff": tradeoff(runs)}
    (out_dir / "serve_bench.json").write_text(json.dumps(report, indent=1))
    text = markdown(report)
    (out_dir / "serve_bench.md").write_text(text)
    return text
