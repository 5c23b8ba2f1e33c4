"""The dashboard as a person sees it, in headless Chromium (selenium, Debian's
/usr/bin/chromium and /usr/bin/chromedriver; .ci/run installs them), over a
live in-process server with real members: the job listed with its state; its
page with each node's ranks; an event arriving live, without a reload; the
token form, and no job data, until an admin token is typed; markup in an
event shown as text, never run; and the pages of a sealed job, an unknown
one and a replica that does not lead.

Selenium blocks, so every browser call runs in a thread (the server runs on
the test's event loop); nothing sleeps: WebDriverWait polls the page."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile

import grpc
import pytest

from commctx.server import start_server
from commctx.server.rendezvous.model import EventKind
from commctx.server.tokens import Callers
from commctx.v1 import rendezvous_pb2 as pb
from commctx.v1 import rendezvous_pb2_grpc as pb_grpc

from .conftest import eventually, join_request
from .test_detect import GRACE, TTL, world

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the `test` extra")
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"no {CHROMIUM} and {CHROMEDRIVER}: apt-get install chromium chromium-driver (.ci/run does)",
                allow_module_level=True)

from selenium.common.exceptions import TimeoutException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

pytestmark = pytest.mark.timeout(120)
WAIT_S = 20  # for anything the page should show; the page refreshes every 2 s and streams events as they come
MARKUP = '<script>window.pwned=1</script><img src=x onerror="window.pwned=2">'
ADMIN_TOKEN, USER_TOKEN = "admin-token-0123456789", "user-token-0123456789"


@pytest.fixture(scope="module")
def driver():
    """One headless Chromium for the module, with a fresh profile (flags for a machine without a network)."""
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="commctx-dashboard-test-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,900", f"--user-data-dir={profile}"):
        options.add_argument(flag)
    d = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    d.set_page_load_timeout(WAIT_S)
    try:
        yield d
    finally:
        d.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Page:
    """The browser, from async tests: each selenium call in a thread."""

    def __init__(self, driver, base: str) -> None:
        self.driver, self.base = driver, base

    async def open(self, path: str) -> None:
        await asyncio.to_thread(self.driver.get, self.base + path)

    async def js(self, script: str, *args):
        return await asyncio.to_thread(self.driver.execute_script, script, *args)

    async def until(self, what: str, check, timeout: float = WAIT_S):
        """Waits until check(driver) is truthy; fails saying what was awaited, with the page's text."""
        try:
            return await asyncio.to_thread(WebDriverWait(self.driver, timeout, poll_frequency=0.05).until, check)
        except TimeoutException:
            text = await self.js("return document.body.innerText")
            pytest.fail(f"the page did not show {what} within {timeout} s; it shows:\n{text[:3000]}")

    async def text(self, css: str, contains: str = "", timeout: float = WAIT_S) -> str:
        """The text (as shown) of the first visible element matching css and containing `contains`, once
        there is one. Read in the page in one go: the pages rebuild what they show as they refresh."""
        find = """
            for (const e of document.querySelectorAll(arguments[0])) {
                if (e.getClientRects().length && e.innerText.includes(arguments[1])) return e.innerText;
            }
            return null;"""
        return await self.until(f"{css!r} with {contains!r}" if contains else repr(css),
                                lambda d: d.execute_script(find, css, contains))

    async def content(self, css: str) -> str | None:
        """textContent of the first element matching css (None: none)."""
        return await self.js("const e = document.querySelector(arguments[0]); return e && e.textContent", css)

    async def click(self, css: str) -> None:
        await self.js("document.querySelector(arguments[0]).click()", css)

    async def body(self) -> str:
        return await self.js("return document.body.innerText")

    async def leave(self) -> None:
        """Away from the server's pages (it stops after the test; the page would keep polling it)."""
        await asyncio.to_thread(self.driver.get, "about:blank")


@pytest.fixture
async def server():
    s = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, reconnect_grace_s=GRACE, http_port=0)
    yield s
    await s.stop(0)


@pytest.fixture
async def stub(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.RendezvousStub(channel)


@pytest.fixture
async def page(driver, server):
    p = Page(driver, f"http://127.0.0.1:{server.http_port}")
    yield p
    await p.leave()


async def test_the_job_is_listed_its_page_shows_the_ranks_per_node_and_a_loss_arrives_live(server, stub, page):
    members = await world(stub, "train", 3)  # 3 nodes (n0, n1, n2) of one worker, sessions open, formed
    try:
        await page.open("/")
        row = await page.text('#jobs tbody tr[data-job="train"]')
        assert "formed" in row and "3 / 3" in row
        link = '#jobs tr[data-job="train"] a.job-link'
        assert await page.content(link) == "train"
        assert (await page.js("return document.querySelector(arguments[0]).href", link)).endswith("/jobs/train")
        await page.click(link)

        await page.text(".wgrid .cell")
        rows = await page.js("""return [...document.querySelectorAll('.wgrid tbody tr')].map(tr => [
            tr.querySelector('.node-key').textContent, tr.querySelector('.node-rank').textContent,
            [...tr.querySelectorAll('.cell')].map(c => c.textContent)])""")
        seats = {(f"#{m.joined.assignment.node_rank}", str(m.joined.assignment.rank)) for m in members}
        assert {(rank, cells[0]) for _, rank, cells in rows} == seats  # each node's rank and its worker's global rank
        assert sorted(key for key, _, _ in rows) == ["n0", "n1", "n2"]
        assert "formed" in await page.text("#job-state")
        # the lease legend in words: TTL 30 s, renewed every 10 s; all three renewing
        legend = " ".join((await page.text("#legend", "healthy")).split())
        assert "healthy: renewed in the last 10 s 3" in legend and "ttl" not in legend, legend
        assert await page.content("#legend .legend-count") == "3"
        assert await page.js("return document.getElementById('exposed').hidden") is True  # a loopback server
        await page.text("#events .ev[data-kind='formed']")
        await page.text("#live", "live")

        await page.js("window.stillHere = true")  # gone if the page were reloaded
        members[2].call.cancel()  # its process killed: the session reset, no Leave
        lost = await page.text("#events .ev[data-kind='lost']")
        assert "disconnected" in lost and "rank 2" in lost
        assert await page.js("return window.stillHere") is True
        await page.text("#events .ev[data-kind='formed']", "generation 2")  # the world re-formed without it
        await page.until("generation 2 in the summary",
                         lambda d: d.execute_script("return document.querySelector('#stats .stat-value').textContent") == "2")
        assert await page.js("return window.stillHere") is True
    finally:
        for m in members:
            m.close()


async def test_markup_from_the_server_is_shown_as_text_and_never_run(server, stub, page):
    members = await world(stub, "markup", 2)
    try:
        await page.open("/jobs/markup")
        await page.text("#events .ev[data-kind='formed']")
        machine = server.machine
        machine._event(machine._jobs["markup"], EventKind.REFUSED, MARKUP, machine._outbox)
        server.executor.submit(machine.take_outbox())
        assert MARKUP in await page.text("#events .ev[data-kind='refused']")  # live, over the stream, as text
        assert await page.content("#events .ev[data-kind='refused'] .msg") == MARKUP
        assert await page.js("return typeof window.pwned") == "undefined"
        assert await page.js("return document.querySelectorAll('script:not([src]), img').length") == 0

        await page.open("/")  # the list shows it as the job's last event
        assert MARKUP in await page.text('#jobs tbody tr[data-job="markup"]', "refused")
        assert await page.content('#jobs tr[data-job="markup"] .last-event .msg') == MARKUP
        assert await page.js("return typeof window.pwned") == "undefined"
        assert await page.js("return document.querySelectorAll('script:not([src]), img').length") == 0
    finally:
        for m in members:
            m.close()


async def test_with_auth_tokens_the_page_asks_for_an_admin_token_and_shows_nothing_without_it(driver, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{USER_TOKEN}\n{ADMIN_TOKEN} admin\n")
    server = await start_server("127.0.0.1", 0, lease_ttl_s=TTL, http_port=0, callers=Callers(tokens))
    page = Page(driver, f"http://127.0.0.1:{server.http_port}")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            joined = await pb_grpc.RendezvousStub(channel).Join(join_request("guarded-job", 1),
                                                               metadata=[("authorization", f"Bearer {USER_TOKEN}")])
        assert joined.assignment.generation == 1
        for path in ("/", "/jobs/guarded-job"):
            await page.open(path)
            assert "admin token" in await page.text("#auth", "admin token")
            await page.text("#auth form")
            assert await page.js("return document.getElementById('content').hidden") is True
            assert await page.js("return document.querySelectorAll('#jobs tbody tr, #stats .stat, #events .ev, .wgrid').length") == 0
            if path == "/":
                assert "guarded-job" not in await page.body()

        await page.open("/")
        for typed, shown in ((USER_TOKEN, None), (ADMIN_TOKEN, '#jobs tbody tr[data-job="guarded-job"]')):
            await page.text("#auth form")
            field = await asyncio.to_thread(driver.find_element, By.CSS_SELECTOR, "#auth input[type=password]")
            await asyncio.to_thread(field.send_keys, typed + "\n")  # typed, then Enter
            if shown is None:  # a token that is not an admin's: asked again, saying so
                await page.text("#auth .error", "not accepted")
                assert await page.js("return document.querySelectorAll('#jobs tbody tr').length") == 0
            else:
                assert "formed" in await page.text(shown)
        assert await page.js("return sessionStorage.getItem('commctx.token')") == ADMIN_TOKEN  # for the tab only
        await page.open("/jobs/guarded-job")  # kept for the tab: no form again
        assert await page.text(".wgrid .cell") == "0"
        assert await page.js("return document.getElementById('auth').hidden") is True
    finally:
        await page.leave()
        await server.stop(0)


async def test_a_server_open_to_the_network_without_authentication_says_so_on_every_page(driver):
    """commctx-server itself (the warning is its start-up's), --host 0.0.0.0 without tokens."""
    from .cluster import Server

    argv = [sys.executable, "-m", "commctx.server", "--host", "0.0.0.0", "--port", "0", "--http-port", "0", "--store", "memory"]
    server = await asyncio.to_thread(Server, "127.0.0.1", argv=argv, metrics=True)
    page = Page(driver, "http://127.0.0.1:" + server.http_url.rsplit(":", 1)[1].strip("/"))
    try:
        for path in ("/", "/jobs/no-such-job"):
            await page.open(path)
            banner = await page.text("#exposed", "without authentication")
            assert banner.startswith("Open to the network without authentication")
            assert f"serving on 0.0.0.0:{server.port} to the network without authentication" in banner
            assert "set --auth-tokens or --tls-client-ca" in banner and "WARNING:" not in banner
        colour = await page.js("return getComputedStyle(document.querySelector('.exposed-title')).color")
        assert colour.startswith("rgb(199, 58, 58)"), colour  # --bad, red
    finally:
        await page.leave()
        await asyncio.to_thread(server.stop)


async def test_a_sealed_job_an_unknown_one_and_a_replica_that_does_not_lead(server, stub, page):
    waiting = asyncio.ensure_future(stub.Join(join_request("sealed-job", 2, job_secret="s3cret-of-16-chars")))
    try:
        await eventually(lambda: "sealed-job" in server.machine.job_ids())
        await page.open("/")
        row = await page.text('#jobs tbody tr[data-job="sealed-job"]')
        assert "sealed" in row and "forming" in row and "1 / 2" not in row

        await page.open("/jobs/sealed-job")
        assert "admin token" in await page.text("#notice", "sealed")
        assert await page.js("return document.getElementById('content').hidden") is True
        assert await page.js("return document.querySelectorAll('#stats .stat, #events .ev, .wgrid .cell').length") == 0

        await page.open("/jobs/no-such-job")
        assert "no-such-job" in await page.text("#notice", "No such job")
        assert await page.js("return document.getElementById('content').hidden") is True

        await server.end_term("10.9.8.7:50051")  # a replica that lost its leadership
        await page.open("/jobs/sealed-job")
        assert "10.9.8.7:50051" in await page.text("#notice", "does not lead")
        await page.open("/")
        assert "10.9.8.7:50051" in await page.text("#notice", "does not lead")
        assert "follower" in await page.text("#server")
    finally:
        waiting.cancel()


async def test_a_run_that_ended_is_listed_and_its_page_says_who_took_part(server, stub, page):
    members = await world(stub, "done", 2)  # elastic: n0 leaving re-forms it as generation 2, n1 alone
    for m in members:  # both leave: the run has ended
        await m.stub.Leave(pb.LeaveRequest(job_id="done", member_id=m.joined.member_id, member_secret=m.joined.member_secret))
        m.close()
    await page.open("/")
    row = await page.text('#ended tbody tr[data-job="done"]')
    assert row.split("\t")[1:6] == ["1", "ended", "2", "1 on 1 node", "0s"] and "(node 'n1', rank 0) left, the last to go" in row, row
    assert (await page.js("return document.querySelector('#ended a.job-link').href")).endswith("/jobs/done?run=1")
    assert await page.js("return document.getElementById('jobs-empty').hidden") is False  # nothing live
    await page.click("#ended a.job-link")
    took = await page.text("#took-part tbody")
    assert [line.split() for line in took.splitlines()] == [["0", "n1", "127.0.0.1", "1"]]  # its last world
    assert "Run 1 ended" in await page.text("#took-part-note")
    assert await page.js("return document.getElementById('grid-panel').hidden") is True
    await page.text("#events .ev[data-kind='ended']")
    await page.text("#live", "run ended")
