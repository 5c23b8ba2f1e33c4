"""The dashboard at scale: the jobs list of a server holding 10,000 jobs, and the page of a 10,000-worker job.

(a) `/` with 10,000 jobs: the first page of the API (GET /api/v1/jobs, 100
    jobs), timed from this process over HTTP; and the page in headless
    Chromium, from navigation until its table is drawn.
(b) `/jobs/<id>` of a formed 10,000-worker job, as 1,250 nodes x 8 workers
    (node memberships, as torchrun's agents join) and as 10,000 nodes x 1:
    each node page of the API (GET /api/v1/jobs/<id>, 2,000 nodes a page, as
    the page reads them), and the page in Chromium from navigation until the
    worker grid is drawn.

How: the server runs in this process (start_server, memory store, HTTP on a
free port; unpinned); the jobs and members are made in-process, through the
state machine and the executor (server.machine.join, then
server.executor.submit: no gRPC, no sessions; the lease is an hour, so no
member expires during the run). The 10,000 jobs are 9,000 formed ones of one
node x 8 workers and 1,000 forming ones of one node of 16 (each with its
joined and formed events). The page timings are the page's own performance
marks ('commctx:jobs-drawn', 'commctx:grid-drawn', set in
server/web/assets/app.js once the table or grid is drawn and a frame has
passed), read with selenium, relative to the navigation's start; each page is
loaded --repeat times in one browser after one unmeasured load (the first
run of a fresh Chromium profile is reported apart). Chromium is Debian's
(/usr/bin/chromium, /usr/bin/chromedriver), headless, 1440 x 900.

    python benchmarks/dashboard.py [--repeat 5] [--jobs 10000] [--workers 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import urllib.request

JOBS_PAGE = 100
NODE_PAGE = 2000  # as the page reads them (server/web/assets/app.js NODE_PAGE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="page loads measured per page (default 5)")
    parser.add_argument("--jobs", type=int, default=10_000, help="jobs on the server for (a) (default 10,000)")
    parser.add_argument("--workers", type=int, default=10_000, help="workers of the big job for (b) (default 10,000)")
    args = parser.parse_args()
    asyncio.run(run(args))


# -- the server and its jobs, in-process -------------------------------------------------


def join(server, job: str, node: str, world: int, workers: int = 1, i: int = 0) -> None:
    """One Join through the state machine and the executor, as the servicer makes it."""
    from commctx.server.rpc import codec
    from commctx.v1 import rendezvous_pb2 as pb

    request = pb.JoinRequest(job_id=job, node_key=node, address=f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}",
                             master_port=20000 + i % 40000, workers=workers)
    spec = codec.spec_from_message(pb.JobSpec(world_size=world))
    _, actions, _ = server.machine.join(codec.join_params(request, spec))
    server.executor.submit(actions)


async def formed(server, job: str) -> None:
    from commctx.server.rendezvous.model import JobState

    while server.machine.describe(job, max_nodes=0).state is not JobState.FORMED:
        await asyncio.sleep(0.05)


async def many_jobs(server, n: int) -> None:
    for k in range(n):
        if k % 10 == 9:  # forming: one node of two
            join(server, f"job-{k:05d}", f"node-{k:05d}", 16, 8, k)
        else:
            join(server, f"job-{k:05d}", f"node-{k:05d}", 8, 8, k)
        if k % 500 == 499:
            await asyncio.sleep(0)  # let the executor write and publish
    await formed(server, "job-00000")


async def big_job(server, job: str, workers: int, per_node: int) -> None:
    nodes = workers // per_node
    for i in range(nodes):
        join(server, job, f"host-{i:05d}", workers, per_node, i)
        if i % 500 == 499:
            await asyncio.sleep(0)
    await formed(server, job)


# -- measuring -----------------------------------------------------------------------------


def get(url: str) -> tuple[float, bytes]:
    """ms for the whole answer, and the answer."""
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read()
    return (time.perf_counter() - t) * 1000, body


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="commctx-bench-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1440,900", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    driver.profile_dir = profile
    return driver


def page_time(driver, url: str, mark: str) -> dict:
    """Navigates to url; ms from the navigation's start until the page set `mark`, and its API calls."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get("about:blank")
    driver.get(url)
    WebDriverWait(driver, 60, poll_frequency=0.02).until(
        lambda d: d.execute_script("return performance.getEntriesByName(arguments[0]).length > 0", mark))
    return driver.execute_script("""
        const m = performance.getEntriesByName(arguments[0])[0];
        const api = performance.getEntriesByType('resource').filter(r => r.name.includes('/api/v1/') && r.responseEnd <= m.startTime);
        return {ms: m.startTime, api_calls: api.length,
                api_ms: api.reduce((a, r) => a + (r.responseEnd - r.requestStart), 0),
                bytes: api.reduce((a, r) => a + (r.encodedBodySize || 0), 0)};
    """, mark)


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):7.1f} ms   min {min(values):7.1f}   max {max(values):7.1f}"


async def run(args: argparse.Namespace) -> None:
    from commctx.server import start_server
    from commctx.server.rendezvous.model import Limits

    print(f"$ python benchmarks/dashboard.py --repeat {args.repeat} --jobs {args.jobs} --workers {args.workers}")
    print(f"# {time.strftime('%Y-%m-%d')}; {os.cpu_count()} cores ({platform.machine()}), Python {platform.python_version()}, "
          f"{chromium_version()}; server and browser unpinned; load average {os.getloadavg()[0]:.2f} at the start")
    limits = Limits(max_jobs=max(10_000, args.jobs + 2))
    server = await start_server("127.0.0.1", 0, lease_ttl_s=3600.0, http_port=0, limits=limits)
    base = f"http://127.0.0.1:{server.http_port}"
    driver = await asyncio.to_thread(browser)
    try:
        # (a) the jobs list
        t = time.perf_counter()
        await many_jobs(server, args.jobs)
        print(f"# (a) {args.jobs:,} jobs made in {time.perf_counter() - t:.1f} s (in-process)")
        api = [await asyncio.to_thread(get, f"{base}/api/v1/jobs?page_size={JOBS_PAGE}") for _ in range(args.repeat + 1)]
        print(f"GET /api/v1/jobs?page_size={JOBS_PAGE} (first page, {len(api[0][1]):,} bytes): "
              f"{summary([ms for ms, _ in api[1:]])}   (first call {api[0][0]:.1f} ms)")
        await report_page(driver, f"{base}/", "commctx:jobs-drawn", "/ until the table is drawn", args.repeat)
        # (b) the big job's page, in two shapes
        for per_node in (8, 1):
            job = f"big-{args.workers}x{per_node}"
            t = time.perf_counter()
            await big_job(server, job, args.workers, per_node)
            nodes = args.workers // per_node
            print(f"# (b) {job}: {nodes:,} nodes x {per_node}, formed in {time.perf_counter() - t:.1f} s (in-process)")
            pages = []
            for _ in range(args.repeat):
                one, token, total_bytes = [], "", 0
                while True:
                    url = f"{base}/api/v1/jobs/{job}?node_page_size={NODE_PAGE}" + (f"&node_page_token={token}" if token else "")
                    ms, body = await asyncio.to_thread(get, url)
                    one.append(ms)
                    total_bytes += len(body)
                    token = json.loads(body)["next_node_page_token"]
                    if not token:
                        break
                pages.append((sum(one), len(one), total_bytes, max(one)))
            print(f"GET /api/v1/jobs/{job} all {pages[0][1]} node pages ({pages[0][2]:,} bytes): "
                  f"{summary([p[0] for p in pages])}   (largest page: {statistics.median([p[3] for p in pages]):.1f} ms)")
            await report_page(driver, f"{base}/jobs/{job}", "commctx:grid-drawn", f"/jobs/{job} until the grid is drawn",
                              args.repeat)
    finally:
        await asyncio.to_thread(driver.quit)
        shutil.rmtree(driver.profile_dir, ignore_errors=True)
        await server.stop(0)


async def report_page(driver, url: str, mark: str, what: str, repeat: int) -> None:
    first = await asyncio.to_thread(page_time, driver, url, mark)  # unmeasured: the profile's first load of it
    runs = [await asyncio.to_thread(page_time, driver, url, mark) for _ in range(repeat)]
    r = runs[len(runs) // 2]
    print(f"page {what}: {summary([x['ms'] for x in runs])}   (first load {first['ms']:.1f} ms; "
          f"{r['api_calls']} API calls, {r['api_ms']:.0f} ms of them, {r['bytes']:,} bytes)")


def chromium_version() -> str:
    import subprocess

    try:
        return subprocess.run(["/usr/bin/chromium", "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return "no chromium"


if __name__ == "__main__":
    main()
