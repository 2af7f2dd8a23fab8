"""How long attnroll takes to start: ``import attnroll`` and ``attnroll --help`` set against the interpreter's
own start (``python -c pass``) and ``import torch``, each a fresh process, side by side in one run.

Every round runs each command once, in an order rotated from round to round, so that a machine whose speed
drifts (other work on it) touches every command alike; the table gives each command's min and median wall
time over the rounds, then the differences and ratios that matter: what ``import attnroll`` adds to
``import torch``, and what ``attnroll --help`` costs over a bare interpreter. The machine's load average
(/proc/loadavg) before and after is printed with the figures.

``--before DIR`` adds the same attnroll commands run from another checkout's ``src`` folder (for example the
tree before a change), timed in the same rounds.

Usage: python benchmarks/bench_startup.py [--rounds 7] [--src SRC] [--before OTHER_SRC]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

#: ``attnroll --help`` as the console script runs it (attnroll._entry:main), without needing it installed.
HELP = "import sys; sys.argv[0] = 'attnroll'; from attnroll._entry import main; main()"


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def commands(src: Path, before: Path | None) -> dict[str, tuple[list[str], dict[str, str]]]:
    """label -> (argv, environment)."""
    py = sys.executable

    def env(path: Path | None) -> dict[str, str]:
        e = dict(os.environ)
        e.pop("PYTHONPATH", None)
        if path is not None:
            e["PYTHONPATH"] = str(path)
        return e

    out = {"python -c pass": ([py, "-c", "pass"], env(src)),
           "import torch": ([py, "-c", "import torch"], env(src))}
    trees = [("", src)] + ([(" [before]", before)] if before is not None else [])
    for tag, path in trees:
        out[f"import attnroll{tag}"] = ([py, "-c", "import attnroll"], env(path))
        out[f"attnroll --help{tag}"] = ([py, "-c", HELP, "--help"], env(path))
        out[f"import attnroll + first use{tag}"] = ([py, "-c", "import attnroll; attnroll.explain"], env(path))
    return out


def run_once(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed (exit {done.returncode}): {done.stderr.strip()[-500:]}")
    return dt


def measure(cmds: dict, rounds: int) -> dict[str, list[float]]:
    labels = list(cmds)
    times: dict[str, list[float]] = {k: [] for k in labels}
    for k in labels:  # warm-up: the file cache holds every module afterwards
        run_once(*cmds[k])
    for r in range(rounds):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for k in order:
            times[k].append(run_once(*cmds[k]))
    return times


def report(times: dict[str, list[float]], before: bool) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    print("| command (fresh process) | min s | median s |")
    print("|---|---|---|")
    for k, v in times.items():
        print(f"| {k} | {min(v):.3f} | {med[k]:.3f} |")
    base, torch_ = med["python -c pass"], med["import torch"]
    print("\nmedians compared:")
    for tag in [""] + ([" [before]"] if before else []):
        imp, hlp, use = med[f"import attnroll{tag}"], med[f"attnroll --help{tag}"], \
            med[f"import attnroll + first use{tag}"]
        print(f"  import attnroll{tag}: {imp - torch_:+.3f} s vs import torch, ratio {imp / torch_:.2f}x; "
              f"{imp - base:+.3f} s over python -c pass")
        print(f"  attnroll --help{tag}: {hlp - base:+.3f} s over python -c pass, {hlp / torch_:.2f}x import torch")
        print(f"  import attnroll + first use of explain{tag}: {use - torch_:+.3f} s vs import torch")
    if before:
        for what in ("import attnroll", "attnroll --help"):
            print(f"  {what}: before {med[what + ' [before]']:.3f} s, now {med[what]:.3f} s, "
                  f"{med[what + ' [before]'] / med[what]:.1f}x faster")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed runs of each command (after one warm-up)")
    ap.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[1] / "src",
                    help="the src folder whose attnroll is timed (default: this checkout's)")
    ap.add_argument("--before", type=Path, default=None, help="another src folder, timed in the same rounds")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    for p in filter(None, (args.src, args.before)):
        if not (p / "attnroll" / "__init__.py").is_file():
            ap.error(f"{p} holds no attnroll package (expected {p / 'attnroll' / '__init__.py'})")
    cmds = commands(args.src, args.before)
    print(f"python {sys.version.split()[0]}, torch {metadata.version('torch')}, {os.cpu_count()} CPUs, "
          f"{args.rounds} rounds; load average (1, 5, 15 min) before: {load()}")
    times = measure(cmds, args.rounds)
    print(f"load average after: {load()}\n")
    report(times, args.before is not None)


if __name__ == "__main__":
    main()
