"""Makes the README's dashboard screenshots (docs/img/dashboard.png, docs/img/job.png).

Starts a rendezvous server in this process (memory store, HTTP on a free
port) with a realistic demo over real gRPC calls, its members held by live
sessions: `ppo-llama-70b`, 16 nodes x 8 workers (12 trainer nodes, 4
rollout nodes, tp=8, a trainer group and a weight-sync group), restarted
once by its launcher and refusing a 17th node, one node renewing its lease
late and one that stopped renewing; `sft-8b-eval`, forming, a node missing
and a join refused; `diffusion-xl`, elastic, re-formed without a lost node;
`grpo-qwen-32b`, failed when a member's session dropped; a sealed job; and a
few more. Then opens the dashboard and the PPO job's page (a worker of the
hung node selected) in headless Chromium (/usr/bin/chromium with
/usr/bin/chromedriver, selenium) and writes full-page PNGs. Takes about 40 s:
the lease colours need time to age.

    python docs/screenshots.py [--out docs/img] [--width 1440] [--keep]

--keep leaves the demo running after the screenshots (prints its URL) until
interrupted, to look at it in a browser.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import pathlib
import random
import shutil
import tempfile

HERE = pathlib.Path(__file__).resolve().parent

TTL = 30.0          # the lease; members renew every RENEW_S, one node every SLOW_S, one not at all
RENEW_S = 6.0
SLOW_S = 14.0
HUNG_NODE = "gpu-013"
SLOW_NODE = "gpu-009"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=HERE / "img", help="where the PNGs go (default: docs/img)")
    parser.add_argument("--width", type=int, default=1440, help="browser width in CSS pixels (default 1440)")
    parser.add_argument("--keep", action="store_true", help="keep the demo server running afterwards")
    args = parser.parse_args()
    asyncio.run(run(args))


class Member:
    """A joined membership kept alive by its session, as a launcher's agent does:
    renews every `every` seconds and offers a new spare port after each assignment."""

    def __init__(self, stub, job: str, node: str, joined, every: float, port: int) -> None:
        self.stub, self.job, self.node, self.joined, self.every, self.port = stub, job, node, joined, every, port
        self.generation = joined.assignment.generation or (joined.worker_assignments[0].generation
                                                           if joined.worker_assignments else 0)
        self.call = None
        self.tasks: list[asyncio.Task] = []

    def request(self, **kw):
        from commctx.v1 import rendezvous_pb2 as pb

        return pb.SessionRequest(job_id=self.job, member_id=self.joined.member_id, member_secret=self.joined.member_secret,
                                 generation=self.generation, **kw)

    async def open(self, phase: float = 0.0) -> None:
        self.call = self.stub.Session()
        self.port += 1
        await self.call.write(self.request(spare_port=self.port))
        self.tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._renew(phase))]

    async def _read(self) -> None:
        import grpc

        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            while (event := await self.call.read()) is not grpc.aio.EOF:
                if event.HasField("assignment"):
                    self.generation = event.assignment.generation
                    self.port += 1
                    await self.call.write(self.request(spare_port=self.port))  # rank 0's next spare
                elif event.HasField("gone"):
                    return

    async def _renew(self, phase: float) -> None:
        import grpc

        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError, grpc.aio.UsageError):
            await asyncio.sleep(phase)
            while self.every:
                await self.call.write(self.request())
                await asyncio.sleep(self.every)

    def crash(self) -> None:
        """As a killed process: the stream is reset, no Leave."""
        for t in self.tasks:
            t.cancel()
        if self.call is not None:
            self.call.cancel()


async def node_join(stub, job: str, spec, node: str, i: int, workers: int = 8, role: str = "", **kw):
    from commctx.v1 import rendezvous_pb2 as pb

    return await stub.Join(pb.JoinRequest(job_id=job, spec=spec, node_key=node, address=f"10.4.{i // 250}.{i % 250 + 1}",
                                          master_port=29400 + i, wait_timeout_ms=600_000, workers=workers, role=role, **kw))


async def demo(stub, members: list[Member], pending: list[asyncio.Future]) -> None:
    """The jobs of the screenshots."""
    import grpc

    from commctx.v1 import rendezvous_pb2 as pb

    async def formed(job, spec, nodes, every=RENEW_S, **kw) -> list[Member]:
        joined = await asyncio.gather(*(node_join(stub, job, spec, n, i, **{**kw, **extra})
                                        for i, (n, extra) in enumerate(nodes)))
        out = [Member(stub, job, n, j, every, 31000 + 100 * i) for i, (j, (n, _)) in enumerate(zip(joined, nodes))]
        for m in out:
            await m.open(phase=random.uniform(0, every))
        members.extend(out)
        return out

    # Other jobs, in the list.
    await formed("bert-ft-3", pb.JobSpec(world_size=16), [(f"cpu-{i:02d}", {}) for i in range(2)])
    await formed("llama-pretrain-405b", pb.JobSpec(world_size=512, layout=pb.ParallelLayout(tp=8, pp=4)),
                 [(f"h200-{i:03d}", {}) for i in range(64)])
    await formed("dpo-mistral-7b", pb.JobSpec(world_size=32), [(f"l40s-{i:02d}", {}) for i in range(4)])
    await formed("tokenizer-sweep-12", pb.JobSpec(world_size=4), [("cpu-big-1", {"workers": 4})])
    diffusion = await formed("diffusion-xl", pb.JobSpec(world_size=64, elastic=pb.Elastic(min_size=48, last_call_ms=1000)),
                             [(f"h100-{i:02d}", {}) for i in range(8)])
    diffusion[5].crash()  # elastic: lost after the reconnect grace, re-forms with 56
    members.remove(diffusion[5])
    await formed("eval-private", pb.JobSpec(world_size=8), [(f"a10-{i}", {"workers": 4}) for i in range(2)],
                 job_secret="demo-secret-0042")

    # The failed one: a member's session dropped in a world that cannot shrink.
    grpo = await formed("grpo-qwen-32b", pb.JobSpec(world_size=32), [(f"a100-{i:02d}", {}) for i in range(4)])
    grpo[2].crash()

    # The PPO job: 12 trainer nodes and 4 rollout nodes; restarted once by its launcher; a 17th node refused.
    roles = [pb.RoleCount(role="trainer", count=96), pb.RoleCount(role="rollout", count=32)]
    spec = pb.JobSpec(world_size=128, roles=roles, layout=pb.ParallelLayout(tp=8),
                      groups=[pb.GroupRule(mode="TRAINERS", role_group=pb.RoleGroup(roles=["trainer"])),
                              pb.GroupRule(mode="WEIGHT_SYNC", weight_transfer=pb.WeightTransfer(
                                  sender_role="trainer", receiver_roles=["rollout"]))])
    nodes = [(f"gpu-{i:03d}", {"role": "trainer" if i < 12 else "rollout"}) for i in range(16)]
    ppo = await formed("ppo-llama-70b", spec, nodes)
    await asyncio.sleep(1.0)
    await ppo[6].call.write(ppo[6].request(restart_generation=ppo[6].generation))  # as torchrun --max-restarts does
    for _ in range(200):  # generation 2 forms once every survivor renewed
        if all(m.generation == 2 for m in ppo):
            break
        await asyncio.sleep(0.1)
    with contextlib.suppress(grpc.aio.AioRpcError):
        await node_join(stub, "ppo-llama-70b", spec, "gpu-016", 16, role="rollout")
    for m in members:  # one node renews late, one hangs (its connection stays: found by its lease)
        if m.node == SLOW_NODE:
            m.every = SLOW_S
        elif m.node == HUNG_NODE:
            m.every = 0.0

    # The forming one: a node missing, and a join refused for the wrong world size.
    sft = pb.JobSpec(world_size=32, expected_nodes=["eval-a", "eval-b", "eval-c", "eval-d"])
    pending += [asyncio.ensure_future(node_join(stub, "sft-8b-eval", sft, n, i)) for i, n in enumerate(["eval-a", "eval-b", "eval-c"])]
    await asyncio.sleep(0.5)
    with contextlib.suppress(grpc.aio.AioRpcError):
        await node_join(stub, "sft-8b-eval", pb.JobSpec(world_size=64), "eval-x", 9)


async def run(args: argparse.Namespace) -> None:
    import grpc

    from commctx.server import start_server
    from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

    random.seed(7)
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=1.0, http_port=0)
    url = f"http://127.0.0.1:{server.http_port}"
    members: list[Member] = []
    pending: list[asyncio.Future] = []
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = pb_grpc.RendezvousStub(channel)
        await demo(stub, members, pending)
        print(f"demo at {url}", flush=True)
        await asyncio.sleep(TTL * 0.72)  # the hung node's lease is well aged, not yet expired
        args.out.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(shoot, url, args.out, args.width)
        if args.keep:
            print(f"serving {url} until interrupted", flush=True)
            await asyncio.Event().wait()
    finally:
        for m in members:
            m.crash()
        for p in pending:
            p.cancel()
        await channel.close()
        await server.stop(0)


def browser(width: int, height: int = 900):
    """Headless Debian Chromium, its flags for a machine without a network."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="commctx-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--hide-scrollbars", "--force-device-scale-factor=1",
                 f"--window-size={width},{height}", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))
    driver.profile_dir = profile
    return driver


def close(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)


def shoot(url: str, out: pathlib.Path, width: int) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser(width)
    try:
        driver.get(url + "/")
        WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#jobs tbody tr")))
        full_page(driver, out / "dashboard.png", min_height=640)
        driver.get(url + "/jobs/ppo-llama-70b")
        WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.CSS_SELECTOR, ".wgrid .cell, #grid canvas")))
        WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.CSS_SELECTOR, "#events .ev")))
        driver.execute_script("document.querySelector(\".wgrid .cell[data-rank='106']\").click()")  # the hung node
        full_page(driver, out / "job.png")
    finally:
        close(driver)
    for name in ("dashboard.png", "job.png"):
        print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)", flush=True)


def full_page(driver, path: pathlib.Path, min_height: int = 0) -> None:
    """The whole page: the window made as tall as the document, then a screenshot."""
    width = driver.execute_script("return window.innerWidth")
    height = max(min_height, driver.execute_script("return document.documentElement.scrollHeight"))
    driver.set_window_size(width, height + (driver.execute_script("return window.outerHeight - window.innerHeight") or 0))
    driver.execute_async_script("requestAnimationFrame(() => requestAnimationFrame(arguments[0]))")  # laid out again
    driver.save_screenshot(str(path))


if __name__ == "__main__":
    main()
