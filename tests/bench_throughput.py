"""Throughput benchmark: prints figures, asserts nothing.

    python tests/bench_throughput.py [--latency 0.05] [--capacity 16]

A loopback endpoint answers after a fixed latency, serving at most
``capacity`` requests at once.  The script times Featherweight v2 (300
questions) with 1 to 16 workers through the standalone command, the
plugin's own cost per question at zero latency, and loading a generated
100,000-question test file.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import support  # noqa: E402

WORKERS = (1, 2, 4, 8, 16)
TEST = "featherweight_v2.jsonl"


def throttled_endpoint(latency, capacity):
    slots = threading.BoundedSemaphore(capacity)

    def script(body, n):
        with slots:
            time.sleep(latency)    # the simulated model: busy for ``latency`` seconds
        return "A"
    return support.Endpoint(script)


def timed_run(plugins, url, workers):
    """Wall time of the question loop (the result's elapsed_seconds)."""
    proc = support.run_standalone(plugins, "run", TEST[:-6], "--server", url,
                                  "--workers", str(workers))
    if proc.returncode != 0:
        raise SystemExit(proc.stdout + proc.stderr)
    path = max(support.results(plugins), key=os.path.getmtime)
    elapsed = support.read_json(path)["elapsed_seconds"]
    os.unlink(str(path))
    return elapsed


def bare_round_trips(url, prompts):
    """Seconds for the same requests from a minimal client: the floor."""
    started = time.perf_counter()
    for prompt in prompts:
        body = json.dumps({"history": [{"role": "user", "content": prompt}]}).encode()
        request = urllib.request.Request(url + "/api/chat", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            json.loads(response.read().decode())
    return time.perf_counter() - started


def load_figures(module, folder, count=100000):
    path = os.path.join(folder, "big.jsonl")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps({"_meta": True, "name": "Big"}) + "\n")
        for i in range(count):
            handle.write(json.dumps({
                "id": "q%d" % i, "category": "cat%d" % (i % 10),
                "question": "Question number %d: which of these is right?" % i,
                "choices": ["first %d" % i, "second", "third", "fourth"],
                "answer": "ABCD"[i % 4]}) + "\n")
    best = min(_seconds(lambda: module.load_test(path)) for _ in range(3))
    tracemalloc.start()
    module.load_test(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best, peak, os.path.getsize(path)


def _seconds(action):
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--latency", type=float, default=0.05, help="seconds per request (0.05)")
    parser.add_argument("--capacity", type=int, default=16, help="requests served at once (16)")
    args = parser.parse_args()
    folder = tempfile.mkdtemp()
    try:
        plugins = support.install_plugin(__import__("pathlib").Path(folder))
        support.copy_benchmark(plugins, TEST)
        print("Python %s, %d cores" % (sys.version.split()[0], os.cpu_count() or 1))
        print()
        print("Featherweight v2 (300 questions), latency %g ms, capacity %d"
              % (args.latency * 1000, args.capacity))
        print()
        print("| workers | wall time | questions/s | speed-up | ideal | of ideal |")
        print("|---:|---:|---:|---:|---:|---:|")
        endpoint = throttled_endpoint(args.latency, args.capacity)
        base = None
        for workers in WORKERS:
            elapsed = timed_run(plugins, endpoint.url, workers)
            base = base or elapsed
            ideal = min(workers, args.capacity)
            print("| %d | %.2f s | %.1f | %.2fx | %dx | %.0f%% |" % (
                workers, elapsed, 300 / elapsed, base / elapsed, ideal, 100 * base / elapsed / ideal))
        endpoint.close()

        fast = support.Endpoint(lambda body, n: "A")
        module = support.load_module()
        test = module.load_test(support.benchmark(TEST))
        prompts = [module.build_prompt(q) for q in test.questions]
        bare = min(bare_round_trips(fast.url, prompts) for _ in range(3))
        plugin = min(timed_run(plugins, fast.url, 1) for _ in range(3))
        fast.close()
        print()
        print("Zero latency, 1 worker, 300 questions: plugin %.3f s, bare HTTP client %.3f s"
              % (plugin, bare))
        print("Plugin overhead per question: %.3f ms (journal, parsing, scoring, progress)"
              % ((plugin - bare) / len(prompts) * 1000))

        seconds, peak, size = load_figures(module, folder)
        print()
        print("Load and validate 100,000 questions (%.1f MB): %.3f s, peak memory %.1f MB"
              % (size / 1e6, seconds, peak / 1e6))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
