"""Benchmark ups-comm-hooks' DDP communication hooks against plain float32 all-reduce, over a
link of limited bandwidth that the benchmark builds itself.

The link: two network namespaces (``ups-bench-comm-PID-0`` and ``-1``) joined by a veth pair,
10.77.0.1/24 and 10.77.0.2/24, ``lo`` up in both, and on both ends a ``tc`` token bucket
(``tbf rate R burst max(64 KiB, 2 ms of R) latency 50ms``) on the egress, so each direction
carries at most R. Each rate of ``--rates`` (default 200mbit and 1gbit; ``unlimited``: no
qdisc) is measured in turn on the same pair, and everything is removed after, whatever happens
(Ctrl-C and SIGTERM included). Traffic stays inside the namespaces. It needs root, ``ip`` and
``tc`` (iproute2), and refuses in one line without them.

Per rate, two ranks (gloo, world size 2), rank r in namespace r (``ip netns exec``, with
``MASTER_ADDR=10.77.0.1`` and ``GLOO_SOCKET_IFNAME`` its veth end, so gloo binds to the shaped
link), each running ``_comm_worker.py``: one model per hook, the same on every rank (an MLP of
``--layers`` ``Linear(--width, --width)``; by default 3 x 2048: 12,589,056 float32 parameters,
50 MB of gradients; batch ``--batch`` 8, so compute is small next to communication; one intra-op
thread per rank on this 2-core machine), wrapped in DDP (``bucket_cap_mb`` 25, the engine's
default), its hook registered through the plugin registry as the engine does, plain SGD. Hooks
(``--hooks``): ``none`` (DDP's own all-reduce, the baseline, always measured), ``allreduce``,
``bf16``, ``fp16``, ``powersgd`` with ``matrix_approximation_rank`` 4 and
``start_powersgd_iter`` 2, and every other hook the registry has when it runs (with those two
options, and ``start_iter`` 2, where it takes them). Every hook is warmed up (``--warmup`` steps,
plus its ``start_powersgd_iter`` or ``start_iter`` where it has one: past the steps it
all-reduces plainly), then ``--rounds``
rounds each run every hook's ``--steps`` timed steps, in order and reversed in alternate rounds;
a round starts with a timed plain ``dist.all_reduce`` of 50 MB (the link probe).

Reported per rate and hook (median [min, max] over the rounds):

- step time: the median of rank 0's step times in the round (forward, backward with the
  hook's communication, SGD step), and its ratio to the baseline's in the same round;
- bytes per step handed to collectives by a rank, and the ratio to the baseline's (the float32
  gradients' bytes): from the hook state's ``comm_metrics`` where it has one (ups-comm-hooks'
  ``Traffic``), from torch's ``PowerSGDState`` count of elements after compression x 4 for a
  state holding one, ``numel x 4`` for ``none``;
- bytes per step each rank's veth end sent (``/sys/class/net/IF/statistics/tx_bytes``: TCP/IP
  headers and gloo's algorithm included; a 2-rank all-reduce sends about the buffer's bytes
  each way), and their ratio to the baseline's: a check on the count above that needs no hook.

Targets (issue): bytes per step, bf16 <= 0.5x and PowerSGD rank 4 <= 0.1x plain all-reduce; on a
bandwidth-limited link (checked at rates up to 200 Mbit/s), step time of PowerSGD rank 4 <=
0.6x and of bf16 <= 0.75x. Whether the limit holds: the probe's and the baseline's veth send
rate against the configured rate, and the qdiscs' counters (packets over the limit, drops).

Usage: ``python benchmarks/bench_comm.py [--rates 200mbit,1gbit] [--hooks HOOK ...] [--rounds N]
[--steps N] [--warmup N] [--width N] [--layers N] [--batch N] [--json FILE]``, as root; a hook
is ``NAME`` or ``NAME:OPTIONS_JSON``, e.g. ``'powersgd:{"matrix_approximation_rank":4}'``
(``nox -s bench_comm`` runs it). Prints a Markdown table and writes a JSON file (default
``.nox-reports/bench_comm.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _stats import source_state, summary

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
WORKER = HERE.parent / "_comm_worker.py"

ADDRESSES = ("10.77.0.1", "10.77.0.2")
PORT = 29577
POWERSGD = {"matrix_approximation_rank": 4, "start_powersgd_iter": 2}
"""PowerSGD's options here."""
EXTRA_OPTIONS = {**POWERSGD, "start_iter": 2}
"""Those of them (and ``start_iter``, as ``topk``'s) that every other registered hook is given
where it takes them."""
DEFAULT_HOOKS = ["none", "allreduce", "bf16", "fp16", f"powersgd:{json.dumps(POWERSGD)}"]
TIME_TARGETS_UP_TO = 200e6
"""The step-time targets are the bandwidth-limited link's: checked at rates up to this (bit/s)."""
SHORT = {"matrix_approximation_rank": "rank", "start_powersgd_iter": "start", "start_iter": "start"}
SOURCES = {
    "comm_metrics": "the hook state's count (`comm_metrics`)",
    "numel x 4": "the float32 gradients' bytes (numel x 4)",
    "PowerSGDState": "torch's `PowerSGDState` count of elements after compression x 4",
    "unknown": "unknown (see the veth column)",
}
UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}


def fail(message: str) -> int:
    print(f"bench_comm: {message}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------
# The link


def parse_rate(text: str) -> tuple[str, float | None]:
    """``200mbit`` -> (``200mbit``, 2e8); ``unlimited`` -> (``unlimited``, None)."""
    text = text.strip().lower()
    if text in ("unlimited", "none", "off"):
        return "unlimited", None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", text)
    if match is None:
        raise ValueError(f"rate {text!r}: write it as tc does, e.g. 200mbit or 1gbit")
    return text, float(match[1]) * UNITS[match[2]]


def run(*command: str) -> str:
    """Run a command; its stdout, or RuntimeError with its stderr in one line."""
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        detail = " ".join((done.stderr or done.stdout).split())
        raise RuntimeError(f"`{' '.join(command)}` failed: {detail}")
    return done.stdout


class Link:
    """Two namespaces joined by a veth pair, shaped by tbf at both ends; :meth:`destroy` removes
    whatever :meth:`create` made, even half made."""

    def __init__(self, tag: int) -> None:
        self.namespaces = (f"ups-bench-comm-{tag}-0", f"ups-bench-comm-{tag}-1")
        self.interfaces = (f"ucomm{tag}a", f"ucomm{tag}b")  # at most 15 characters
        self._made: list[str] = []

    def create(self) -> None:
        for ns in self.namespaces:
            run("ip", "netns", "add", ns)
            self._made.append(ns)
        a, b = self.interfaces
        run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        self._made.append("veth")
        for ns, dev, address in zip(self.namespaces, self.interfaces, ADDRESSES, strict=True):
            run("ip", "link", "set", dev, "netns", ns)
            run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", dev)
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "-n", ns, "link", "set", dev, "up")

    def shape(self, bits_per_s: float | None) -> None:
        """Limit each end's egress to ``bits_per_s`` (None: no qdisc of ours)."""
        for ns, dev in zip(self.namespaces, self.interfaces, strict=True):
            if bits_per_s is None:
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True
                )
                continue
            burst = max(64 * 1024, int(bits_per_s / 8 / 500))  # 2 ms at the rate
            run(
                "tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                "rate", f"{int(bits_per_s)}bit", "burst", str(burst), "latency", "50ms",
            )  # fmt: skip

    def qdisc_stats(self) -> list[dict[str, Any]]:
        """What each end's root qdisc says: its line, bytes and packets sent, drops, overlimits."""
        stats = []
        for ns, dev in zip(self.namespaces, self.interfaces, strict=True):
            text = run("tc", "-s", "-n", ns, "qdisc", "show", "dev", dev, "root")
            entry: dict[str, Any] = {"dev": dev, "qdisc": " ".join(text.split())}
            sent = re.search(
                r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+) requeues (\d+)\)",
                text,
            )
            if sent:
                keys = ("sent_bytes", "sent_packets", "dropped", "overlimits", "requeues")
                entry.update(zip(keys, map(int, sent.groups()), strict=True))
            stats.append(entry)
        return stats

    def destroy(self) -> list[str]:
        """Remove the namespaces (and the veth pair with them); problems, if any."""
        problems = []
        for ns in reversed(self.namespaces):
            if ns in self._made:
                try:
                    run("ip", "netns", "del", ns)
                except RuntimeError as error:
                    problems.append(str(error))
        # A pair still in the root namespace (create stopped before moving it) goes on its own.
        if "veth" in self._made:
            shown = subprocess.run(["ip", "link", "show", self.interfaces[0]], capture_output=True)
            if shown.returncode == 0:
                try:
                    run("ip", "link", "del", self.interfaces[0])
                except RuntimeError as error:
                    problems.append(str(error))
        self._made.clear()
        return problems


# ---------------------------------------------------------------------------------------------
# The hooks


def label_of(name: str, options: dict[str, Any]) -> str:
    if not options:
        return name
    return name + " " + " ".join(f"{SHORT.get(k, k)}={v}" for k, v in options.items())


def resolve_hooks(specs: list[str] | None) -> list[dict[str, Any]]:
    """The hooks to measure, ``none`` first; each checked against the registry here, so a typo
    fails before any namespace exists."""
    import attrs

    from ups.core import load_plugins

    registry = load_plugins()
    known = registry.records("comm_hook")
    if specs is None:
        specs = list(DEFAULT_HOOKS)
        named = {s.split(":", 1)[0] for s in specs}
        for name in sorted(set(known) - named):
            options_class = known[name].record.options
            fields = attrs.fields_dict(options_class) if attrs.has(options_class) else {}
            takes = {k: v for k, v in EXTRA_OPTIONS.items() if k in fields}
            specs.append(f"{name}:{json.dumps(takes)}" if takes else name)
    hooks: list[dict[str, Any]] = []
    for spec in specs:
        name, _, text = spec.partition(":")
        options = json.loads(text) if text else {}
        if not isinstance(options, dict):
            raise ValueError(f"hook {spec!r}: the options must be a JSON object")
        registry.select("comm_hook", name, options, "comm_hook")  # ConfigError if wrong
        hooks.append({"label": label_of(name, options), "name": name, "options": options})
    if not any(h["name"] == "none" for h in hooks):
        hooks.insert(0, {"label": "none", "name": "none", "options": {}})
    labels = [h["label"] for h in hooks]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a hook is given twice: {labels}")
    return hooks


def targets(hook: dict[str, Any], bits_per_s: float | None) -> dict[str, float]:
    """The issue's targets for this hook at this rate: ratios to plain all-reduce's."""
    name, options = hook["name"], hook["options"]
    found: dict[str, float] = {}
    if name == "bf16":
        found = {"bytes": 0.5, "time": 0.75}
    elif "powersgd" in name and options.get("matrix_approximation_rank") == 4:
        found = {"bytes": 0.1, "time": 0.6}
    if bits_per_s is None or bits_per_s > TIME_TARGETS_UP_TO:
        found.pop("time", None)
    return found


# ---------------------------------------------------------------------------------------------
# The ranks


def run_ranks(
    link: Link, hooks: list[dict[str, Any]], args: argparse.Namespace, port: int
) -> list[dict[str, Any]]:
    """Both ranks, one per namespace; their results, or RuntimeError when one fails (the other
    is killed then)."""
    processes: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as files:
        try:
            outputs = []
            for rank in (0, 1):
                config = {
                    "rank": rank,
                    "ifname": link.interfaces[rank],
                    "hooks": hooks,
                    "width": args.width,
                    "layers": args.layers,
                    "batch": args.batch,
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "rounds": args.rounds,
                    "threads": args.threads,
                    "timeout_s": args.timeout,
                }
                env = {
                    **os.environ,
                    "MASTER_ADDR": ADDRESSES[0],
                    "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": link.interfaces[rank],
                    "OMP_NUM_THREADS": str(args.threads),
                }
                out = files.enter_context(tempfile.TemporaryFile())
                outputs.append(out)
                command = ["ip", "netns", "exec", link.namespaces[rank], sys.executable]
                command += [str(WORKER), json.dumps(config)]
                processes.append(subprocess.Popen(command, stdout=out, env=env))
            wait(processes, args.timeout)
            results = []
            for out in outputs:
                out.seek(0)
                results.append(json.loads(out.read().decode().strip().splitlines()[-1]))
            return results
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()


def wait(processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Wait until every process has exited; RuntimeError when one fails or time is up (the
    caller kills those left)."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in processes):
        failed = [rank for rank, p in enumerate(processes) if p.returncode]
        if failed:
            code = processes[failed[0]].returncode
            raise RuntimeError(f"rank {failed[0]} exited with status {code}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks were still running after {timeout:.0f} s (--timeout)")
        time.sleep(0.2)
    for rank, process in enumerate(processes):
        if process.returncode:
            raise RuntimeError(f"rank {rank} exited with status {process.returncode}")


# ---------------------------------------------------------------------------------------------
# Analysis and report


def ratio(values: list[float], target: float | None) -> dict[str, Any]:
    """The median, min and max of per-round ratios, against an upper ``target``."""
    result: dict[str, Any] = {"per_round": values, **summary(values)}
    if target is not None:
        result.update(target=f"<= {target}", met=result["median"] <= target)
    return result


def median(values: list[float]) -> float:
    return summary(values)["median"]


def analyse(
    ranks: list[dict[str, Any]], hooks: list[dict[str, Any]], bits_per_s: float | None
) -> dict[str, Any]:
    """Per hook, step times, bytes and ratios to the baseline; the link's check."""
    rounds = list(zip(ranks[0]["rounds"], ranks[1]["rounds"], strict=True))
    base = next(h["label"] for h in hooks if h["name"] == "none")

    def step(r: tuple[dict[str, Any], ...], label: str) -> float:
        return median(r[0]["hooks"][label]["step_s"])

    def tx(r: tuple[dict[str, Any], ...], label: str) -> float:
        return sum(x["hooks"][label]["tx_bytes_per_step"] for x in r) / len(r)

    entries: dict[str, Any] = {}
    for hook in hooks:
        label = hook["label"]
        goals = targets(hook, bits_per_s)
        blocks = [r[0]["hooks"][label] for r in rounds]
        entry: dict[str, Any] = {
            "name": hook["name"],
            "options": hook["options"],
            "step_s": summary([step(r, label) for r in rounds]),
            "step_s_all": summary([t for b in blocks for t in b["step_s"]]),
            "time_ratio": ratio(
                [step(r, label) / step(r, base) for r in rounds], goals.get("time")
            ),
            "bytes_source": blocks[0]["bytes_source"],
            "wire_tx_per_step": summary([tx(r, label) for r in rounds]),
            "wire_ratio": ratio([tx(r, label) / tx(r, base) for r in rounds], None),
        }
        if all(b["bytes_per_step"] is not None for b in blocks):
            handed = [float(b["bytes_per_step"]) for b in blocks]
            entry["bytes_per_step"] = summary(handed)
            entry["bytes_ratio"] = ratio(
                [h / ranks[0]["grad_bytes"] for h in handed], goals.get("bytes")
            )
        entries[label] = entry

    def sent_mbit_s(r: tuple[dict[str, Any], ...]) -> float:
        """The baseline's veth send rate over its timed steps, the mean of the ranks'."""
        rates = []
        for x in r:
            block = x["hooks"][base]
            sent = block["tx_bytes_per_step"] * len(block["step_s"])
            rates.append(sent * 8 / sum(block["step_s"]) / 1e6)
        return sum(rates) / len(rates)

    probes = [[x["probe"] for x in r] for r in rounds]
    link: dict[str, Any] = {
        "probe_bytes": probes[0][0]["bytes"],
        "probe_s": summary([p[0]["seconds"] for p in probes]),
        "probe_goodput_mb_s": summary([p[0]["bytes"] / p[0]["seconds"] / 1e6 for p in probes]),
        "probe_tx_mbit_s": summary(
            [sum(x["tx_bytes"] * 8 / x["seconds"] for x in p) / len(p) / 1e6 for p in probes]
        ),
        "baseline_tx_mbit_s": summary([sent_mbit_s(r) for r in rounds]),
    }
    if bits_per_s is not None:
        link["probe_tx_of_rate"] = link["probe_tx_mbit_s"]["median"] * 1e6 / bits_per_s
        link["baseline_tx_of_rate"] = link["baseline_tx_mbit_s"]["median"] * 1e6 / bits_per_s
        # Shaped when the link carries no more than the rate (a little over: the burst) and
        # most of it (gloo keeps it busy during a large all-reduce).
        link["limit_effective"] = 0.7 <= link["probe_tx_of_rate"] <= 1.05
    return {"baseline": base, "hooks": entries, "link": link}


def spread(c: dict[str, float], digits: int, scale: float = 1.0) -> str:
    return (
        f"{c['median'] / scale:.{digits}f} "
        f"[{c['min'] / scale:.{digits}f}, {c['max'] / scale:.{digits}f}]"
    )


def markdown(rows: list[tuple[str, ...]]) -> str:
    return "\n".join("| " + " | ".join(row) + " |" for row in rows)


def table(result: dict[str, Any]) -> str:
    """The results as Markdown: hook x rate, then the link's check."""
    rows: list[tuple[str, ...]] = [
        (
            "rate",
            "hook",
            "step time, s",
            "time / fp32",
            "MB/step handed",
            "bytes / fp32",
            "veth MB/step",
            "veth / fp32",
            "targets",
        ),
        ("---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---"),
    ]
    checks: list[tuple[str, ...]] = [
        (
            "rate",
            f"plain all_reduce of {result['model']['grad_bytes'] / 1e6:.0f} MB, s",
            "goodput, MB/s",
            "veth send, Mbit/s per rank",
            "of the rate",
            "baseline's veth send, Mbit/s",
            "tbf overlimits / dropped",
            "limit holds",
        ),
        ("---", "---:", "---:", "---:", "---:", "---:", "---:", "---"),
    ]
    for rate in result["rates"]:
        name = rate["rate"]
        for label, h in rate["hooks"].items():
            marks = []
            for kind, key in (("bytes", "bytes_ratio"), ("time", "time_ratio")):
                c = h.get(key, {})
                if "met" in c:
                    marks.append(f"{kind} {c['target']}: {'yes' if c['met'] else '**NO**'}")
            has_bytes = "bytes_per_step" in h
            rows.append(
                (
                    name,
                    f"`{label}`" + (" (baseline)" if label == rate["baseline"] else ""),
                    spread(h["step_s"], 3),
                    spread(h["time_ratio"], 3),
                    spread(h["bytes_per_step"], 3, 1e6) if has_bytes else "?",
                    spread(h["bytes_ratio"], 4) if has_bytes else "?",
                    spread(h["wire_tx_per_step"], 3, 1e6),
                    spread(h["wire_ratio"], 4),
                    "; ".join(marks),
                )
            )
        link = rate["link"]
        qdiscs = rate["qdiscs"]
        checks.append(
            (
                name,
                spread(link["probe_s"], 3),
                spread(link["probe_goodput_mb_s"], 1),
                spread(link["probe_tx_mbit_s"], 0),
                f"{link['probe_tx_of_rate']:.2f}" if "probe_tx_of_rate" in link else "",
                spread(link["baseline_tx_mbit_s"], 0),
                " / ".join(f"{q.get('overlimits', '-')}/{q.get('dropped', '-')}" for q in qdiscs),
                ""
                if "limit_effective" not in link
                else ("yes" if link["limit_effective"] else "**NO**"),
            )
        )
    m, s = result["model"], result["settings"]
    header = (
        f"Model: {m['params']:,} float32 parameters ({s['layers']} x Linear({s['width']}, "
        f"{s['width']}), batch {s['batch']}), 2 ranks (gloo) in 2 network namespaces over a veth "
        f"pair shaped by tbf; {s['rounds']} rounds of {s['steps']} timed steps per hook after "
        f"{s['warmup']} warm-up steps (+ the hook's start_powersgd_iter or start_iter); median "
        f"[min, max] over the rounds of rank 0's median step; bytes per step of one rank. "
        f"{result['machine']['cpus']} "
        f"cores, load {result['machine']['load_average_1min']['before']:.2f} before, "
        f"{result['machine']['load_average_1min']['after']:.2f} after; torch "
        f"{result['machine']['torch']}; commit {result['source']['commit']}"
        + (" (with changes)" if result["source"]["changes"] else "")
        + "."
    )
    sources: dict[str, list[str]] = {}
    for label, h in result["rates"][0]["hooks"].items():
        sources.setdefault(SOURCES.get(h["bytes_source"], h["bytes_source"]), []).append(label)
    note = "Bytes handed to collectives: " + "; ".join(
        f"{', '.join(f'`{x}`' for x in labels)}: {source}" for source, labels in sources.items()
    )
    return f"{header}\n\n{markdown(rows)}\n\n{note}.\n\nThe link:\n\n{markdown(checks)}"


# ---------------------------------------------------------------------------------------------


def interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rates", default="200mbit,1gbit", help="comma-separated tc rates, or unlimited"
    )
    parser.add_argument(
        "--hooks",
        nargs="+",
        metavar="HOOK",
        help="NAME or NAME:OPTIONS_JSON, each one argument (default: none, allreduce, bf16, fp16,"
        " powersgd rank 4 start 2, and every other registered hook); none is always added",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds (hooks interleaved)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per hook and round")
    parser.add_argument("--warmup", type=int, default=2, help="warm-up steps per hook")
    parser.add_argument("--width", type=int, default=2048, help="the Linear layers' width")
    parser.add_argument("--layers", type=int, default=3, help="Linear layers")
    parser.add_argument("--batch", type=int, default=8, help="batch size per rank")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="seconds both ranks may take, per rate"
    )
    parser.add_argument("--json", type=Path, default=ROOT / ".nox-reports" / "bench_comm.json")
    args = parser.parse_args(argv)
    if min(args.rounds, args.steps, args.width, args.layers, args.batch, args.threads) < 1:
        parser.error("--rounds, --steps, --width, --layers, --batch, --threads must be >= 1")
    if args.warmup < 2:
        parser.error("--warmup must be at least 2 (DDP rebuilds its buckets after step 1)")
    try:
        rates = [parse_rate(r) for r in args.rates.split(",") if r.strip()]
    except ValueError as error:
        parser.error(str(error))
    if not rates:
        parser.error("--rates: give at least one")
    if os.geteuid() != 0:
        return fail("must run as root: it creates network namespaces, a veth pair and tc qdiscs")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return fail(f"`{tool}` not found: the link is built with iproute2 (ip netns, tc)")
    try:
        hooks = resolve_hooks(args.hooks)
    except Exception as error:  # ConfigError, JSON errors: one line
        return fail(f"--hooks: {error}")

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    link = Link(os.getpid())
    print(
        f"hooks: {', '.join(h['label'] for h in hooks)}; rates: "
        f"{', '.join(r for r, _ in rates)}; namespaces {' and '.join(link.namespaces)}",
        flush=True,
    )
    began, load_before = time.perf_counter(), os.getloadavg()
    source = source_state("packages/ups-comm-hooks/src", "packages/ups-dist-core/src", "benchmarks")
    measured: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    try:
        link.create()
        for i, (name, bits_per_s) in enumerate(rates):
            print(f"  {name}:", flush=True)
            link.shape(bits_per_s)
            ranks = run_ranks(link, hooks, args, PORT + i)
            measured.append(
                {
                    "rate": name,
                    "bits_per_s": bits_per_s,
                    **analyse(ranks, hooks, bits_per_s),
                    "qdiscs": link.qdisc_stats(),
                    "ranks": ranks,
                }
            )
    except KeyboardInterrupt:
        print("bench_comm: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as error:
        return fail(str(error))
    finally:
        for problem in link.destroy():
            print(f"bench_comm: teardown: {problem}", file=sys.stderr)
    result = {
        "command": shlex.join(["python", "benchmarks/bench_comm.py", *argv]),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": importlib.metadata.version("torch"),
            "threads_per_rank": ranks[0]["threads"],
            "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        },
        "source": source,  # as the run began
        "settings": {
            "rates": [r for r, _ in rates],
            "hooks": hooks,
            "rounds": args.rounds,
            "steps": args.steps,
            "warmup": args.warmup,
            "width": args.width,
            "layers": args.layers,
            "batch": args.batch,
            "threads": args.threads,
            "tbf": "rate R burst max(64 KiB, R x 2 ms) latency 50ms, both ends' egress",
        },
        "model": {"params": ranks[0]["params"], "grad_bytes": ranks[0]["grad_bytes"]},
        "rates": measured,
        "wall_s": time.perf_counter() - began,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
