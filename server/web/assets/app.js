/* commctx dashboard: the jobs list (/) and a job's page (/jobs/<id>).
 *
 * Plain JS, no build step, nothing loaded from elsewhere. Everything the
 * server sends is shown as text: the DOM is built with createElement and
 * textContent, never from markup. With --auth-tokens the API wants an admin
 * token: typed once into the page, kept in sessionStorage for the tab and
 * sent as `Authorization: Bearer`. */
'use strict';

(() => {
  const TOKEN_KEY = 'commctx.token';
  const REFRESH_MS = 2000;
  const JOBS_PAGE = 100;
  const NODE_PAGE = 2000;          // nodes per /api/v1/jobs/<id> call
  const BIG_REFRESH_MS = 10000;    // a job of more nodes than that: all of them read again at most this often
  const TABLE_MAX_NODES = 32;      // at most this many nodes x TABLE_MAX_COLS local ranks: a table with the ranks written
  const TABLE_MAX_COLS = 16;       // in; anything bigger is drawn on a canvas
  const EVENTS_SHOWN = 500;

  // ---- DOM -----------------------------------------------------------------

  /** el('div', {class: 'x', text: 'y'}, child, 'text', ...): strings become text nodes. */
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'class') e.className = v;
      else if (k === 'text') e.textContent = String(v);
      else if (k === 'title') e.title = String(v);
      else if (k === 'dataset') Object.assign(e.dataset, v);
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? '' : String(v));
    }
    e.append(...nodes(children));
    return e;
  }
  /** Children as nodes: nested arrays flattened; null, undefined and false skipped; anything else as text. */
  function nodes(children) {
    const out = [];
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      out.push(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return out;
  }
  /** Replaces e's children, as el() makes them. */
  function fill(e, ...children) {
    e.replaceChildren(...nodes(children));
  }
  const $ = (id) => document.getElementById(id);
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  // ---- formatting ----------------------------------------------------------

  const nf = new Intl.NumberFormat('en-US');
  const num = (n) => (n === null || n === undefined ? '—' : nf.format(n));

  function duration(s) {
    if (s === null || s === undefined || !isFinite(s)) return '—';
    s = Math.max(0, s);
    if (s < 1) return `${s.toFixed(1)} s`;
    if (s < 60) return `${Math.floor(s)} s`;
    const two = (a, ua, b, ub) => (b ? `${a} ${ua} ${b} ${ub}` : `${a} ${ua}`);
    if (s < 3600) return two(Math.floor(s / 60), 'min', Math.floor(s % 60), 's');
    if (s < 86400) return two(Math.floor(s / 3600), 'h', Math.floor((s % 3600) / 60), 'min');
    return two(Math.floor(s / 86400), 'd', Math.floor((s % 86400) / 3600), 'h');
  }
  function shortDuration(s) {
    if (s === null || s === undefined || !isFinite(s)) return '—';
    s = Math.max(0, s);
    if (s < 60) return `${Math.floor(s)}s`;
    if (s < 3600) return `${Math.floor(s / 60)}m`;
    if (s < 86400) return `${Math.floor(s / 3600)}h`;
    return `${Math.floor(s / 86400)}d`;
  }

  // The server's clock, as its Date headers tell it (event times are the server's wall clock).
  let skewMs = 0;
  function noteClock(res) {
    const d = Date.parse(res.headers.get('Date') || '');
    if (!isNaN(d)) {
      const s = d + 500 - Date.now();  // Date has 1 s resolution
      skewMs = Math.abs(s) > 2000 ? s : 0;
    }
  }
  const serverNow = () => (Date.now() + skewMs) / 1000;
  const ago = (t) => `${shortDuration(serverNow() - t)} ago`;

  function clockTime(t) {
    const d = new Date(t * 1000);
    const today = new Date(serverNow() * 1000).toDateString() === d.toDateString();
    const hms = d.toLocaleTimeString('en-GB', {hour12: false});
    return today ? hms : `${d.toLocaleDateString('en-CA')} ${hms}`;
  }

  /** Ranks as ranges: [0..7] -> "0–7"; [0,8,16,24] -> "0, 8 … 24 (step 8)"; else runs. */
  function rankText(ranks, size) {
    if (!ranks.length) return '—';
    let text;
    const step = ranks.length > 1 ? ranks[1] - ranks[0] : 1;
    const even = ranks.every((r, i) => i === 0 || r - ranks[i - 1] === step);
    if (even && ranks.length > 2 && step === 1) text = `${ranks[0]}–${ranks[ranks.length - 1]}`;
    else if (even && ranks.length > 3) text = `${ranks[0]}, ${ranks[1]} … ${ranks[ranks.length - 1]} (step ${step})`;
    else {
      const runs = [];
      let a = ranks[0], b = ranks[0];
      for (const r of ranks.slice(1).concat([NaN])) {
        if (r === b + 1) { b = r; continue; }
        runs.push(a === b ? `${a}` : b === a + 1 ? `${a}, ${b}` : `${a}–${b}`);
        a = b = r;
      }
      text = runs.join(', ');
    }
    return size > ranks.length ? `${text} … (${num(size)} ranks)` : text;
  }

  // ---- the API -------------------------------------------------------------

  class ApiError extends Error {
    constructor(status, body) {
      super((body && body.error) || `HTTP ${status}`);
      this.status = status;
      this.body = body || {};
    }
  }

  function token() {
    try { return sessionStorage.getItem(TOKEN_KEY) || ''; } catch (e) { return ''; }
  }
  function setToken(t) {
    try {
      if (t) sessionStorage.setItem(TOKEN_KEY, t); else sessionStorage.removeItem(TOKEN_KEY);
    } catch (e) { /* storage off: the token lives until the page goes */ }
    memoryToken = t;
  }
  let memoryToken = '';
  function authHeaders(accept) {
    const h = {Accept: accept};
    const t = token() || memoryToken;
    if (t) h.Authorization = `Bearer ${t}`;
    return h;
  }

  async function api(path, signal) {
    let res;
    try {
      res = await fetch(path, {headers: authHeaders('application/json'), cache: 'no-store', signal});
    } catch (e) {
      if (e && e.name === 'AbortError') throw e;
      throw new ApiError(0, {error: 'the server cannot be reached'});
    }
    noteClock(res);
    let body = null;
    try { body = await res.json(); } catch (e) { body = null; }
    if (!res.ok) throw new ApiError(res.status, body);
    return body;
  }

  // ---- the frame: server badge, notices, the token form ---------------------

  let server = {auth: false, leading: true, leader: null};

  function showServer() {
    const box = $('server');
    const parts = [];
    if (server.leading) {
      parts.push(el('span', {class: 'replica', title: 'This replica serves the rendezvous'}, el('span', {class: 'dot ok'}), 'leader'));
    } else {
      parts.push(el('span', {class: 'replica', title: 'This replica does not serve the rendezvous'},
        el('span', {class: 'dot warn'}), server.leader ? `follower · leader ${server.leader}` : 'follower · no leader yet'));
    }
    if (server.auth && (token() || memoryToken)) {
      parts.push(el('span', {}, 'admin token · ',
        el('button', {type: 'button', class: 'linkish', text: 'forget', onclick: () => { setToken(''); location.reload(); }})));
    }
    fill(box, ...parts);
  }

  /** The server's start-up warnings (it serves the network without authentication): a banner on every page. */
  function showExposure() {
    const box = $('exposed');
    if (!box) return;
    const lines = (server.warnings || []).map((w) => w.replace(/^WARNING: /, ''));
    if (!lines.length) { box.hidden = true; return; }
    fill(box, el('strong', {class: 'exposed-title', text: server.open_to_network
      ? 'Open to the network without authentication' : 'The JSON API is open to the network'}),
    ...lines.map((line) => el('span', {class: 'exposed-text', text: line})));
    box.hidden = false;
  }

  function notice(kind, title, body, link) {
    const n = $('notice');
    n.className = `notice ${kind}`;
    fill(n, el('div', {class: 'notice-title', text: title}),
      body ? el('div', {class: 'notice-body'}, body) : null,
      link ? el('a', {href: link[0], text: link[1]}) : null);
    n.hidden = false;
  }
  const clearNotice = () => { $('notice').hidden = true; };

  /** Says why a call failed. True: the page waits for a token now (stop polling); false: retry later. */
  function failure(err, what) {
    if (err instanceof ApiError && err.status === 401) {
      askToken(token() || memoryToken ? 'That token was not accepted: it must be an admin token of the server\'s --auth-tokens file.' : '');
      return true;
    }
    if (err instanceof ApiError && err.status === 503) {
      const leader = err.body.leader;
      $('content').hidden = true;
      notice('warn', 'This replica does not lead',
        leader ? ['The rendezvous and its jobs are served by the leader: ', el('span', {class: 'mono', text: leader}), '.']
               : 'No replica leads yet (an election is under way); this page retries.');
      return false;
    }
    notice('bad', `Could not load ${what}`, err.message || String(err));
    return false;
  }

  let onToken = null;
  function askToken(error) {
    setToken('');
    showServer();
    $('content').hidden = true;
    clearNotice();
    const hint = el('p', {class: 'error', text: error || null});
    const input = el('input', {type: 'password', name: 'token', placeholder: 'admin token', autocomplete: 'off',
      spellcheck: 'false', 'aria-label': 'Admin token', required: true});
    const form = el('form', {onsubmit: (ev) => {
      ev.preventDefault();
      const t = input.value.trim();
      if (!/^[\x21-\x7e]+$/.test(t)) {   // what an HTTP header can carry
        fill(hint, t ? 'A token here is printable ASCII without spaces.' : '');
        input.focus();
        return;
      }
      setToken(t);
      $('auth').hidden = true;
      showServer();
      if (onToken) onToken();
    }}, input, el('button', {type: 'submit', class: 'btn primary', text: 'Use token'}));
    fill($('auth'),
      el('h1', {text: 'This server needs an admin token'}),
      el('p', {}, 'It was started with ', el('code', {text: '--auth-tokens'}),
        '. Type a token that file marks ', el('code', {text: 'admin'}),
        '; it is kept for this tab only and sent with each request.'),
      form,
      hint);
    $('auth').hidden = false;
    input.focus();
  }

  async function boot(start) {
    onToken = start;
    try {
      server = await api('/api/v1/server');
    } catch (err) {
      notice('bad', 'Could not reach the server', `${err.message}; retrying.`);
      setTimeout(() => boot(start), REFRESH_MS);
      return;
    }
    showServer();
    showExposure();
    if (server.auth && !token()) { askToken(''); return; }
    start();
  }

  /** Runs fn now and then every REFRESH_MS after it finished (not while the tab is hidden). */
  function every(fn, ms = REFRESH_MS) {
    let timer = null, running = false, stopped = false;
    const run = async () => {
      clearTimeout(timer);
      if (stopped || running) return;
      running = true;
      let again = true;
      try { again = (await fn()) !== false; } finally { running = false; }
      if (again && !stopped) timer = setTimeout(() => { if (!document.hidden) run(); }, ms);
      else stopped = true;
    };
    document.addEventListener('visibilitychange', () => { if (!document.hidden && !stopped && !running) run(); });
    run();
    return {now: run, stop: () => { stopped = true; clearTimeout(timer); }};
  }

  function badge(state) {
    return el('span', {class: `badge state-${state}`, text: state});
  }
  function kindBadge(kind) {
    return el('span', {class: `kind kind-${/^[a-z]+$/.test(kind) ? kind : 'other'}`, text: kind});
  }
  const jobHref = (id) => `/jobs/${encodeURIComponent(id)}`;

  // ==========================================================================
  // The jobs list: /
  // ==========================================================================

  function jobsPage() {
    const tokens = [''];   // page tokens of the pages before this one, and this one's
    let loop = null;
    const tbody = $('jobs').tBodies[0];

    async function load() {
      const pageToken = tokens[tokens.length - 1];
      let page;
      try {
        page = await api(`/api/v1/jobs?page_size=${JOBS_PAGE}${pageToken ? `&page_token=${encodeURIComponent(pageToken)}` : ''}`);
      } catch (err) {
        if (failure(err, 'the jobs')) return false;
        return true;
      }
      clearNotice();
      $('content').hidden = false;
      if (!page.jobs.length && tokens.length > 1) { tokens.length = 1; return load(); }  // the page emptied: back to the first
      fill(tbody, ...page.jobs.map(jobRow));
      if (tokens.length === 1) await loadEnded();
      $('jobs-empty').hidden = page.jobs.length > 0;
      if (!page.jobs.length) {
        fill($('jobs-empty'), el('strong', {text: 'No jobs on this server yet'}),
          'Workers that call CommContext.join(job_id=…) appear here as they join.');
      }
      const first = (tokens.length - 1) * JOBS_PAGE + 1;
      $('page-label').textContent = page.jobs.length
        ? `Page ${tokens.length} · jobs ${num(first)}–${num(first + page.jobs.length - 1)}` : '';
      $('prev').disabled = tokens.length === 1;
      $('next').disabled = !page.next_page_token;
      $('next').dataset.token = page.next_page_token || '';
      $('pager').hidden = tokens.length === 1 && !page.next_page_token;
      fill($('list-meta'), el('span', {}, el('span', {class: 'dot ok'}), ` updated ${clockTime(serverNow())}`));
      if (!performance.getEntriesByName('commctx:jobs-drawn').length) {   // once painted (for benchmarks/dashboard.py)
        requestAnimationFrame(() => setTimeout(() => {
          if (!performance.getEntriesByName('commctx:jobs-drawn').length) performance.mark('commctx:jobs-drawn');
        }, 0));
      }
      return true;
    }

    async function loadEnded() {   // the kept runs that ended, newest first (the first page of them)
      let page;
      try {
        page = await api(`/api/v1/jobs?ended=1&page_size=${JOBS_PAGE}`);
      } catch (err) {
        return;
      }
      const runs = page.jobs.filter((j) => j.ended_at).sort((a, b) => b.ended_at - a.ended_at);
      fill($('ended').tBodies[0], ...runs.map(endedRow));
      $('ended').hidden = !runs.length;
      $('ended-empty').hidden = runs.length > 0;
      if (server && server.retain_ended_s) $('ended-kept').textContent = duration(server.retain_ended_s);
      fill($('ended-empty'), el('strong', {text: 'No run has ended yet'}),
        'A job whose workers have all left is listed here, with who took part and why it ended.');
    }

    $('next').addEventListener('click', () => {
      const t = $('next').dataset.token;
      if (t) { tokens.push(t); loop.now(); window.scrollTo(0, 0); }
    });
    $('prev').addEventListener('click', () => {
      if (tokens.length > 1) { tokens.pop(); loop.now(); window.scrollTo(0, 0); }
    });
    boot(() => { if (loop) loop.stop(); loop = every(load); });
  }

  function jobRow(j) {
    const link = el('a', {class: 'job-link', href: jobHref(j.job_id), text: j.job_id, title: j.job_id});
    if (j.generation === undefined) {  // sealed, and no admin token: its id and state only
      return el('tr', {class: 'sealed-row', dataset: {job: j.job_id}},
        el('td', {}, link, el('div', {class: 'job-sub'}, el('span', {class: 'chip idle', text: 'sealed'}))),
        el('td', {}, badge(j.state)),
        el('td', {class: 'num muted', text: '—'}),
        el('td', {class: 'muted', colspan: 4, text: 'Sealed: only an admin token shows its details.'}));
    }
    const sub = el('div', {class: 'job-sub'},
      j.sealed ? el('span', {class: 'chip idle', text: 'sealed'}) : null,
      j.missing > 0 ? el('span', {class: 'chip bad', text: `${num(j.missing)} missing`}) : null,
      j.refused > 0 ? el('span', {class: 'chip', text: `${num(j.refused)} refused`}) : null,
      j.min_size !== null && j.min_size !== undefined ? el('span', {class: 'muted', text: `elastic, min ${num(j.min_size)}`}) : null);
    const frac = j.world_size ? Math.min(1, j.joined / j.world_size) : 0;
    const done = el('span');
    done.style.width = `${(frac * 100).toFixed(1)}%`;
    const ev = j.last_event;
    return el('tr', {dataset: {job: j.job_id}},
      el('td', {}, link, sub.childNodes.length ? sub : null),
      el('td', {}, el('span', {title: j.reason || ''}, badge(j.state))),
      el('td', {class: 'num', text: num(j.generation)}),
      el('td', {class: 'workers-cell'},
        el('div', {class: 'workers-nums'}, el('span', {}, num(j.joined), el('span', {class: 'of', text: ` / ${num(j.world_size)}`})),
          el('span', {class: 'of', text: j.world_size ? `${Math.floor(frac * 100)}%` : ''})),
        el('div', {class: `bar ${j.state}`}, done)),
      el('td', {class: 'num', text: num(j.num_nodes)}),
      el('td', {class: 'num', text: j.age_s === null ? '—' : shortDuration(j.age_s), title: duration(j.age_s)}),
      el('td', {}, ev ? el('div', {class: 'last-event'}, kindBadge(ev.kind),
        el('span', {class: 'msg', text: ev.message, title: ev.message}),
        el('span', {class: 'ago', text: ago(ev.time), title: new Date(ev.time * 1000).toISOString()}))
        : el('span', {class: 'muted', text: '—'})));
  }

  function endedRow(j) {
    const href = `${jobHref(j.job_id)}?run=${j.run}`;
    const link = el('a', {class: 'job-link', href, text: j.job_id, title: j.job_id});
    if (j.generation === undefined) {  // sealed, and no admin token
      return el('tr', {class: 'sealed-row', dataset: {job: j.job_id, run: j.run}},
        el('td', {}, link), el('td', {class: 'num', text: num(j.run)}), el('td', {}, badge(j.state)),
        el('td', {class: 'muted', colspan: 4, text: 'Sealed: only an admin token shows its details.'}),
        el('td', {class: 'num', text: ago(j.ended_at)}));
    }
    const ran = j.started_at && j.ended_at ? j.ended_at - j.started_at : null;
    return el('tr', {dataset: {job: j.job_id, run: j.run}},
      el('td', {}, link),
      el('td', {class: 'num', text: num(j.run)}),
      el('td', {}, badge(j.state)),
      el('td', {class: 'num', text: num(j.generation)}),
      el('td', {class: 'num', text: `${num(j.joined)} on ${num(j.num_nodes)} node${j.num_nodes === 1 ? '' : 's'}`}),
      el('td', {class: 'num', text: ran === null ? '—' : shortDuration(ran), title: ran === null ? '' : duration(ran)}),
      el('td', {class: 'num', text: ago(j.ended_at), title: new Date(j.ended_at * 1000).toISOString()}),
      el('td', {class: 'reason-cell', text: j.reason || '', title: j.reason || ''}));
  }

  // ==========================================================================
  // A job: /jobs/<job_id>
  // ==========================================================================

  function jobPage() {
    let jobId;
    try { jobId = decodeURIComponent(location.pathname.replace(/^\/jobs\//, '').replace(/\/+$/, '')); }
    catch (e) { jobId = ''; }
    const base = `/api/v1/jobs/${encodeURIComponent(jobId)}`;
    const run = new URLSearchParams(location.search).get('run');
    const runQuery = run && /^[0-9]{1,9}$/.test(run) ? `run=${run}&` : '';   // a run that ended (else the live one)
    $('crumb-job').textContent = runQuery ? `${jobId} · run ${run}` : jobId;
    document.title = `${jobId} · commctx`;

    const grid = new WorkerGrid($('grid'), $('legend'), $('selection'), $('tip'));
    const timeline = new Timeline($('events'), $('older'), $('live'), base, runQuery);
    let loop = null;
    let nodes = [];
    let lastFull = 0, fullCost = 0;   // when every node was last read, and what that took (ms)
    let changed = false;              // an event said who is in the job changed since
    let gone = false;

    async function load() {
      const t0 = performance.now();
      // A job of more nodes than one page: its summary every time (one node), all its nodes only every
      // BIG_REFRESH_MS (or 20x what reading them took), or once an event said it changed (at most every
      // REFRESH_MS): reading 10,000 workers costs the server a quarter of a second.
      const big = nodes.length > NODE_PAGE;
      const since = t0 - lastFull;
      const full = !big || !lastFull || (changed && since > REFRESH_MS) || since > Math.max(BIG_REFRESH_MS, 20 * fullCost);
      let job;
      try {
        job = await api(`${base}?${runQuery}node_page_size=${full ? NODE_PAGE : 1}`);
      } catch (err) {
        return missingJob(err);
      }
      gone = false;
      clearNotice();
      $('auth').hidden = true;
      $('content').hidden = false;
      renderSummary(job);
      renderMissing(job);
      renderGroups(job.groups);
      timeline.seed(job.events);
      if (job.ended_at) return renderEnded(job);   // nothing more will happen to it
      timeline.start();
      if (!full) {
        if (job.num_nodes !== nodes.length) changed = true;   // nodes came or went: all of them soon
        return true;
      }
      const all = job.nodes.slice();
      if (!nodes.length && job.next_node_page_token) grid.set(all, job);   // the first page on screen at once
      for (let tok = job.next_node_page_token; tok;) {
        let page;
        try {
          page = await api(`${base}?${runQuery}node_page_size=${NODE_PAGE}&node_page_token=${encodeURIComponent(tok)}`);
        } catch (err) {
          return missingJob(err);
        }
        for (const n of page.nodes) all.push(n);
        tok = page.next_node_page_token;
      }
      nodes = all;
      changed = false;
      grid.set(nodes, job, big || !!job.next_node_page_token);
      fullCost = performance.now() - t0;
      lastFull = performance.now();
      if (!performance.getEntriesByName('commctx:grid-drawn').length) {   // once painted (for benchmarks/dashboard.py)
        requestAnimationFrame(() => setTimeout(() => {
          if (!performance.getEntriesByName('commctx:grid-drawn').length) performance.mark('commctx:grid-drawn');
        }, 0));
      }
      return true;
    }

    function renderEnded(job) {
      $('grid-panel').hidden = true;
      $('took-part-panel').hidden = false;
      const ran = job.started_at ? ` after ${duration(job.ended_at - job.started_at)}` : '';
      const others = job.other_runs.length ? `; other runs of this id: ${job.other_runs.join(', ')}` : '';
      $('took-part-note').textContent = `Run ${job.run} ended ${ago(job.ended_at)}${ran}. Its last world's nodes${others}.`;
      fill($('groups'), el('div', {class: 'groups-empty', text: 'The run ended: its groups went with its workers.'}));
      fill($('took-part').tBodies[0], ...job.nodes.map((n) => el('tr', {},
        el('td', {class: 'num', text: n.node_rank === null ? '—' : num(n.node_rank)}),
        el('td', {class: 'mono', text: n.node_key}),
        el('td', {class: 'mono', text: (n.addresses || [n.address]).join(', ')}),
        el('td', {class: 'num', text: num(n.took_part)}))));
      timeline.setLive('ended');
      return false;   // no refresh: a run that ended does not change
    }

    function missingJob(err) {
      if (!(err instanceof ApiError)) { notice('bad', 'Could not load the job', String(err)); return true; }
      if (err.status === 401) { timeline.stop(); failure(err); return false; }
      if (err.status === 403 || err.status === 404 || err.status === 400) {
        timeline.stop();
        $('content').hidden = true;
        if (err.status === 403) {
          notice('warn', 'This job is sealed', ['Job ', el('span', {class: 'mono', text: jobId}),
            ' was sealed with a job secret: its page shows nothing without an admin token',
            server.auth ? '.' : ', and this server has none (it runs without --auth-tokens).'], ['/', '← All jobs']);
        } else if (err.status === 404) {
          notice('bad', 'No such job', ['There is no job ', el('span', {class: 'mono', text: jobId}),
            ' on this server', gone ? ' any more: it ended.' : '.'], ['/', '← All jobs']);
        } else {
          notice('bad', 'Not a job id', err.message, ['/', '← All jobs']);
        }
        return false;
      }
      if (err.status === 503) { timeline.stop(); failure(err); return true; }
      notice('bad', 'Could not load the job', err.message);
      return true;
    }

    timeline.onEvent = (ev) => {  // what changes the job: read it again soon
      if (ev.kind !== 'refused') soon();
    };
    timeline.onEnd = () => { gone = true; soon(); };
    timeline.onUnauthorized = () => failure(new ApiError(401, {}));
    timeline.onError = (err) => missingJob(err);
    let soonTimer = null;
    function soon() {
      clearTimeout(soonTimer);
      soonTimer = setTimeout(() => { changed = true; if (loop) loop.now(); }, 250);
    }

    document.querySelectorAll('.seg-btn').forEach((b) => b.addEventListener('click', () => grid.colourBy(b.dataset.colour)));
    $('find').addEventListener('keydown', (e) => {
      if (e.key === 'Enter') { e.preventDefault(); $('find').classList.toggle('not-found', !grid.find($('find').value)); }
    });
    $('find').addEventListener('input', () => { if (!$('find').value) { $('find').classList.remove('not-found'); grid.find(''); } });

    boot(() => { if (loop) loop.stop(); lastFull = 0; loop = every(load); });
  }

  function stat(label, value, note, noteClass) {
    return el('div', {class: 'stat'}, el('div', {class: 'stat-label', text: label}),
      el('div', {class: 'stat-value'}, value),
      note ? el('div', {class: `stat-note ${noteClass || ''}`, text: note}) : null);
  }

  function renderSummary(j) {
    $('job-id').textContent = j.job_id;
    $('job-id').title = j.job_id;
    fill($('job-state'), badge(j.state), j.sealed ? el('span', {class: 'chip idle', text: 'sealed'}) : null);
    const spec = j.spec || {};
    const layout = spec.layout ? Object.entries(spec.layout).filter(([k, v]) => typeof v === 'number' && v > 1)
      .map(([k, v]) => `${k}=${v}`).join(' ') : '';
    const roles = (spec.roles || []).map((r) => `${r.role}×${r.count}`).join(', ');
    let workersNote = '';
    if (j.missing > 0) workersNote = `${num(j.missing)} missing`;
    else if (j.waiting > 0) workersNote = `${num(j.waiting)} waiting for the next generation`;
    else if (j.min_size !== null && j.min_size !== undefined) workersNote = `elastic, min ${num(j.min_size)}`;
    const perNode = j.num_nodes ? j.joined / j.num_nodes : 0;
    fill($('stats'),
      stat('Generation', num(j.generation), {formed: 'formed', failed: 'the job failed', ended: 'the job ended'}[j.state]
        || (j.generation ? 're-forming' : 'first world forming')),
      stat('Workers', [num(j.joined), el('span', {class: 'of', text: ` / ${num(j.world_size)}`})], workersNote,
        j.missing > 0 ? 'bad' : ''),
      stat('Nodes', num(j.num_nodes), perNode ? `${Number.isInteger(perNode) ? perNode : perNode.toFixed(1)} worker${perNode === 1 ? '' : 's'} per node` : ''),
      j.ended_at ? stat('Ran for', j.started_at ? duration(j.ended_at - j.started_at) : '—', `ended ${ago(j.ended_at)}`)
        : stat({formed: 'Formed for', forming: 'Forming for', failed: 'Failed for', ended: 'Ended for'}[j.state] || 'For',
          duration(j.age_s)),
      stat('Lease TTL', j.lease_ttl_s < 60 ? `${j.lease_ttl_s} s` : duration(j.lease_ttl_s), `renewed every ${duration(j.lease_ttl_s / 3)}`),
      stat('Refused joins', num(j.refused), j.refused ? 'the last one is below' : '', j.refused ? 'warn' : ''),
    );
    fill($('job-meta'),
      layout ? el('span', {}, 'layout ', el('span', {class: 'mono', text: layout})) : null,
      roles ? el('span', {}, 'roles ', el('span', {class: 'mono', text: roles})) : null);
    const reason = $('reason');
    reason.hidden = !j.reason;
    reason.className = `reason ${j.state}`;
    fill(reason, el('span', {class: 'reason-label', text: j.state === 'forming' ? 'Why it is not formed' : 'Reason'}),
      j.reason || '');
  }

  function renderMissing(j) {
    const rows = [];
    const add = (label, value) => rows.push(el('dt', {text: label}), el('dd', {}, value));
    if (j.missing > 0) add('Workers missing', `${num(j.missing)} of ${num(j.world_size)} (${num(j.joined)} joined)`);
    if (j.missing_nodes && j.missing_nodes.length) {
      const shown = j.missing_nodes.slice(0, 60);
      add(`Nodes missing (${num(j.missing_nodes.length)})`, el('div', {class: 'node-chips'},
        shown.map((k) => el('span', {class: 'node-chip', text: k})),
        j.missing_nodes.length > shown.length ? el('span', {class: 'muted', text: `and ${num(j.missing_nodes.length - shown.length)} more`}) : null));
    }
    if (j.not_ready > 0) add('Survivors not ready', `${num(j.not_ready)} not heard from since the world changed`);
    if (j.waiting > 0) add('Waiting', `${num(j.waiting)} joined the formed world and wait for the next generation`);
    if (j.refused > 0) {
      add(j.refused === 1 ? 'Refused join' : `Last of ${num(j.refused)} refused`, j.last_refused ? el('div', {class: 'refusal', text: j.last_refused}) : '—');
    }
    $('missing-panel').hidden = rows.length === 0;
    $('missing-title').textContent = j.missing > 0 || j.not_ready > 0 || (j.missing_nodes || []).length ? 'Who is missing' : 'Refused joins';
    fill($('missing'), el('dl', {class: 'missing-grid'}, rows));
  }

  function renderGroups(groups) {
    const box = $('groups');
    if (!groups || !groups.length) {
      fill(box, el('div', {class: 'groups-empty', text: 'No plan yet: the groups are built when the world forms.'}));
      return;
    }
    const open = new Set([...box.querySelectorAll('details[open]')].map((d) => d.dataset.mode));
    const rows = groups.map((g) => {
      const first = g.groups[0];
      const details = el('details', {dataset: {mode: g.mode}},
        el('summary', {}, first ? `#${first.index}: ${rankText(first.ranks, first.size)}` : '—'),
        el('ol', {}, g.groups.map((x) => el('li', {}, el('b', {text: `#${x.index}`}), rankText(x.ranks, x.size),
          x.root !== null && x.root !== undefined ? ` · root ${x.root}` : '')),
        g.count > g.groups.length ? el('li', {text: `… and ${num(g.count - g.groups.length)} more groups`}) : null));
      if (open.has(g.mode)) details.open = true;
      return el('tr', {class: g.sizes.every((x) => x <= 1) ? 'trivial' : null},
        el('td', {class: 'mode'}, g.mode, g.cpu_twin ? el('div', {}, el('span', {class: 'chip idle', text: 'cpu twin'})) : null),
        el('td', {class: 'num', text: num(g.count)}),
        el('td', {class: 'num', text: g.sizes.map(num).join(', ')}),
        el('td', {}, details));
    });
    fill(box, el('table', {class: 'groups'},
      el('thead', {}, el('tr', {}, el('th', {text: 'Mode'}), el('th', {class: 'num', text: 'Groups'}),
        el('th', {class: 'num', text: 'Size'}), el('th', {text: 'Ranks (first groups)'}))),
      el('tbody', {}, rows)));
  }

  // ---- the event timeline: newest first, live over server-sent events -----

  class Timeline {
    constructor(list, older, live, base, query = '') {
      this.list = list; this.older = older; this.live = live; this.base = base; this.query = query;
      this.items = new Map();   // seq -> {event, li}
      this.lastSeq = 0;
      this.oldest = Infinity;
      this.running = false;
      this.abort = null;
      this.onEvent = null; this.onEnd = null; this.onUnauthorized = null; this.onError = null;
      older.addEventListener('click', () => this.loadOlder());
      this.setLive('idle');
    }

    setLive(state) {
      const text = {live: 'live', connecting: 'connecting…', retry: 'reconnecting…', ended: 'run ended', idle: ''}[state];
      const dot = {live: 'ok', connecting: 'warn', retry: 'warn', ended: '', idle: ''}[state];
      fill(this.live, text ? el('span', {class: `dot ${dot}`}) : null, text);
    }

    /** The events the job's own read brought (its last 50). */
    seed(events) {
      for (const e of events || []) {
        const had = this.items.get(e.seq);
        if (!had || had.event.time !== e.time || had.event.message !== e.message) this.put(e, false);
      }
      this.showEmpty();
    }

    showEmpty() {
      const empty = this.list.querySelector('.events-empty');
      if (this.items.size && empty) empty.remove();
      if (!this.items.size && !empty) this.list.append(el('li', {class: 'events-empty', text: 'No events yet.'}));
      this.older.hidden = !(this.oldest > 1 && this.oldest !== Infinity);
    }

    put(e, fresh) {
      if (typeof e.seq !== 'number') return;
      const li = this.item(e, fresh);
      const had = this.items.get(e.seq);
      if (had) {   // a count that grew: the same seq, replaced in place
        had.li.replaceWith(li);
      } else {
        // newest first: before the first item of a lower seq
        let before = null;
        for (const child of this.list.children) {
          const s = Number(child.dataset.seq);
          if (!isNaN(s) && s < e.seq) { before = child; break; }
        }
        this.list.insertBefore(li, before);
      }
      this.items.set(e.seq, {event: e, li});
      this.lastSeq = Math.max(this.lastSeq, e.seq);
      this.oldest = Math.min(this.oldest, e.seq);
      while (this.items.size > EVENTS_SHOWN) {   // keep the newest
        const low = Math.min(...this.items.keys());
        this.items.get(low).li.remove();
        this.items.delete(low);
        this.oldest = Math.min(...this.items.keys());
      }
    }

    item(e, fresh) {
      const said = (v) => typeof v === 'string' && v.length > 12 && e.message.includes(v);   // no need to say it twice
      const fields = Object.entries(e.fields || {}).filter(([k, v]) => k !== 'first' && v !== '' && v !== null && !said(v))
        .map(([k, v]) => `${k}=${typeof v === 'string' ? v : JSON.stringify(v)}`).join('  ');
      return el('li', {class: `ev ev-${e.kind}${fresh ? ' fresh' : ''}`, dataset: {seq: e.seq, kind: e.kind}},
        el('time', {text: clockTime(e.time), title: new Date(e.time * 1000).toISOString(), datetime: new Date(e.time * 1000).toISOString()}),
        el('span', {}, kindBadge(e.kind)),
        el('div', {}, el('span', {class: 'msg', text: e.message}), el('span', {class: 'gen', text: `gen ${e.generation}`})),
        fields ? el('div', {class: 'fields', text: fields}) : null);
    }

    async loadOlder() {
      const before = this.oldest;
      if (!(before > 1)) return;
      const after = Math.max(0, before - 101);
      try {
        const page = await api(`${this.base}/events?${this.query}after=${after}&page_size=100`);
        for (const e of page.events) if (e.seq < before) this.put(e, false);
        if (!page.events.length) this.oldest = 1;   // the older ones are no longer kept
      } catch (err) {
        if (err.status === 401 && this.onUnauthorized) this.onUnauthorized();
      }
      this.showEmpty();
    }

    stop() {
      this.running = false;
      if (this.abort) this.abort.abort();
      this.abort = null;
      this.setLive('idle');
    }

    start() {
      if (this.running) return;
      this.running = true;
      this.follow();
    }

    /** Reads the stream with fetch (so that the Authorization header goes with it); reconnects from the last seq. */
    async follow() {
      let backoff = 500;
      while (this.running) {
        this.abort = new AbortController();
        this.setLive(backoff > 500 ? 'retry' : 'connecting');
        let ended = false, cut = false;
        try {
          // after = last - 1: the last one comes again, with its count if it grew meanwhile
          const res = await fetch(`${this.base}/events/stream?${this.query}after=${Math.max(0, this.lastSeq - 1)}`,
            {headers: authHeaders('text/event-stream'), cache: 'no-store', signal: this.abort.signal});
          if (res.status === 401) { this.running = false; if (this.onUnauthorized) this.onUnauthorized(); return; }
          if (!res.ok) {
            let body = null;
            try { body = await res.json(); } catch (e) { body = null; }
            if (res.status !== 503) { this.running = false; if (this.onError) this.onError(new ApiError(res.status, body)); return; }
            throw new ApiError(res.status, body);
          }
          this.setLive('live');
          backoff = 500;
          const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
          let buf = '';
          for (;;) {
            const {value, done} = await reader.read();
            if (done) break;
            buf += value.replace(/\r\n?/g, '\n');
            let i;
            while ((i = buf.indexOf('\n\n')) >= 0) {
              const block = buf.slice(0, i);
              buf = buf.slice(i + 2);
              const r = this.message(block);
              if (r === 'end') ended = true;
              if (r === 'error') cut = true;
            }
            if (ended || cut) { this.abort.abort(); break; }
          }
        } catch (err) {
          if (!this.running) return;
        }
        if (ended) {
          this.running = false;
          this.setLive('ended');
          if (this.onEnd) this.onEnd();
          return;
        }
        if (!this.running) return;
        if (!cut) {   // a dropped connection: wait a little, longer each time
          this.setLive('retry');
          await sleep(backoff);
          backoff = Math.min(backoff * 2, 10000);
        }
      }
    }

    /** One server-sent event block: returns 'end', 'error' or ''. */
    message(block) {
      let type = 'message', data = [];
      for (const line of block.split('\n')) {
        if (!line || line.startsWith(':')) continue;   // a keep-alive comment
        const at = line.indexOf(':');
        const field = at < 0 ? line : line.slice(0, at);
        let value = at < 0 ? '' : line.slice(at + 1);
        if (value.startsWith(' ')) value = value.slice(1);
        if (field === 'event') type = value;
        else if (field === 'data') data.push(value);
      }
      if (type === 'end') return 'end';
      if (type === 'error') return 'error';
      if (type !== 'job-event' || !data.length) return '';
      let e;
      try { e = JSON.parse(data.join('\n')); } catch (err) { return ''; }
      const isNew = !this.items.has(e.seq) && e.seq > this.lastSeq;
      this.put(e, isNew);
      this.showEmpty();
      if (isNew && this.onEvent) this.onEvent(e);
      return '';
    }
  }

  // ---- the worker grid: node x local rank ---------------------------------

  // Workers renew their lease every third of its TTL: a lease renewed within that is healthy.
  const secs = (s) => `${+s.toFixed(1)} s`;
  const LEASES = [
    ['ok', (ttl) => `healthy: renewed in the last ${secs(ttl / 3)}`],
    ['late', (ttl) => `late: last renewed ${secs(ttl / 3)} to ${secs(2 * ttl / 3)} ago`],
    ['risk', (ttl) => `at risk: not renewed for ${secs(2 * ttl / 3)} (lost at ${secs(ttl)})`],
    ['first', () => 'first lease, not renewed yet'], ['join', () => 'waiting in its join'],
    ['detached', () => 'detached: its session ended, its seat kept for a reconnect'],
  ];

  function leaseClass(w, ttl) {
    switch (w.lease) {
      case 'renewing': {
        const a = w.renewed_s_ago === null ? 0 : w.renewed_s_ago / (ttl || 1);
        return a < 1 / 3 ? 'ok' : a < 2 / 3 ? 'late' : 'risk';
      }
      case 'first': return 'first';
      case 'in join': return 'join';
      case 'detached': return 'detached';
      default: return 'join';
    }
  }
  function leaseText(w) {
    if (w.lease === 'renewing') return w.renewed_s_ago === null ? 'renewing' : `renewed ${w.renewed_s_ago.toFixed(1)} s ago`;
    if (w.lease === 'first') return 'first lease (not renewed yet)';
    if (w.lease === 'in join') return 'in join (waiting to be placed)';
    return w.lease;
  }

  class WorkerGrid {
    constructor(box, legend, selection, tip) {
      this.box = box; this.legendBox = legend; this.selectionBox = selection; this.tip = tip;
      this.nodes = []; this.job = null;
      this.cols = 1;
      this.by = 'role';
      this.roles = new Map();     // role -> palette index
      this.selected = null;       // [node index, slot]
      this.mode = '';
      this.canvas = null;
      this.geo = null;
      this.colours = null;
      this.slots = [];            // per node: workers by slot
      window.addEventListener('resize', () => { if (this.mode === 'canvas') this.draw(); });
      matchMedia('(prefers-color-scheme: dark)').addEventListener?.('change', () => { this.colours = null; this.render(); });
    }

    /** The operator's choice of colouring (kept over refreshes). */
    colourBy(by) { this.picked = true; this.setBy(by); this.render(); }

    setBy(by) {
      this.by = by;
      document.querySelectorAll('.seg-btn').forEach((b) => b.classList.toggle('active', b.dataset.colour === by));
    }

    /** The nodes to show (every page of them), the job they are of; `stamp`: say when they were read. */
    set(nodes, job, stamp = false) {
      this.nodes = nodes; this.job = job;
      this.readAt = stamp ? serverNow() : null;
      const ttl = job.lease_ttl_s;
      this.ttl = ttl;
      // slots: a worker's local rank, else the first free one
      let cols = 1;
      this.slots = nodes.map((n) => {
        const s = [];
        const loose = [];
        for (const w of n.workers) {
          if (w.local_rank !== null && w.local_rank !== undefined && s[w.local_rank] === undefined) s[w.local_rank] = w;
          else loose.push(w);
        }
        let i = 0;
        for (const w of loose) { while (s[i] !== undefined) i++; s[i] = w; }
        cols = Math.max(cols, s.length);
        return s;
      });
      this.cols = cols;
      // roles in the spec's order, then as met
      const roles = new Map();
      for (const r of (job.spec && job.spec.roles) || []) if (!roles.has(r.role)) roles.set(r.role, roles.size);
      for (const n of nodes) for (const w of n.workers) if (w.role && !roles.has(w.role)) roles.set(w.role, roles.size);
      this.roles = roles;
      if (!this.picked) this.setBy(roles.size ? 'role' : 'lease');
      this.missingNodes = job.missing_nodes || [];
      const table = nodes.length + Math.min(this.missingNodes.length, 8) <= TABLE_MAX_NODES && cols <= TABLE_MAX_COLS;
      this.mode = table ? 'table' : 'canvas';
      this.box.parentElement.classList.toggle('beside', table);
      fill($('grid-title'), nodes.length
        ? `Workers · ${num(nodes.length)} node${nodes.length === 1 ? '' : 's'} × ${num(cols)} local rank${cols === 1 ? '' : 's'}`
        : 'Workers', this.readAt ? el('span', {class: 'read-at', text: ` · read ${clockTime(this.readAt)}`,
        title: 'A job this big is read whole every 10 s, and soon after an event changes it'}) : null);
      this.render();
    }

    roleIndex(role) {
      if (!role) return 'none';
      const i = this.roles.get(role);
      return i === undefined ? 'none' : String(i % 8);
    }

    legend() {
      const count = (n) => el('span', {class: 'legend-count', text: num(n), title: `${num(n)} worker${n === 1 ? '' : 's'}`});
      const roleItems = [];
      const counts = new Map();
      for (const n of this.nodes) for (const w of n.workers) counts.set(w.role, (counts.get(w.role) || 0) + 1);
      for (const [role, i] of this.roles) {
        roleItems.push(el('span', {class: 'legend-item'}, el('span', {class: `sw role-${i % 8}`}), role,
          count(counts.get(role) || 0)));
      }
      if (counts.has('')) roleItems.push(el('span', {class: 'legend-item'}, el('span', {class: 'sw role-none'}), 'no role',
        count(counts.get(''))));
      const leaseCounts = new Map();
      for (const n of this.nodes) for (const w of n.workers) {
        const c = leaseClass(w, this.ttl);
        leaseCounts.set(c, (leaseCounts.get(c) || 0) + 1);
      }
      const leaseItems = LEASES.filter(([c]) => leaseCounts.has(c) || c === 'ok').map(([c, label]) =>
        el('span', {class: 'legend-item'}, el('span', {class: `sw lease-${c}`}), label(this.ttl || 0),
          count(leaseCounts.get(c) || 0)));
      fill(this.legendBox,
        this.by === 'role' ? el('div', {class: 'legend-group'}, el('span', {class: 'legend-title', text: 'Role'}), roleItems) : null,
        el('div', {class: 'legend-group'}, el('span', {class: 'legend-title', text: this.by === 'role' ? 'Lease (bar)' : 'Lease'}), leaseItems));
    }

    render() {
      if (!this.job) return;
      this.legend();
      if (!this.nodes.length && !this.missingNodes.length) {
        this.canvas = null;
        fill(this.box, el('div', {class: 'grid-empty', text: 'No worker has joined.'}));
        return;
      }
      this.resolveSelection();
      if (this.mode === 'table') this.renderTable();
      else this.renderCanvas();
      this.showSelection();
    }

    // A table: the ranks written in the cells (small jobs)
    renderTable() {
      this.canvas = null;
      const head = el('tr', {}, el('th', {class: 'node-h', text: 'node \u2192 local rank'}));
      for (let c = 0; c < this.cols; c++) head.append(el('th', {text: String(c)}));
      const rows = this.nodes.map((n, i) => {
        const tr = el('tr', {dataset: {node: n.node_key}},
          el('td', {class: 'node'}, el('span', {class: 'node-rank', text: n.node_rank === null ? '—' : `#${n.node_rank}`}),
            el('span', {class: 'node-key', text: n.node_key}),
            el('span', {class: 'node-addr', text: (n.addresses || [n.address]).join(', ')})));
        for (let c = 0; c < this.cols; c++) {
          const w = this.slots[i][c];
          tr.append(el('td', {class: 'slot'}, w ? this.cellEl(w, i, c) : el('div', {class: 'cell empty'})));
        }
        return tr;
      });
      for (const k of this.missingNodes.slice(0, 8)) {
        const tr = el('tr', {class: 'missing-node'},
          el('td', {class: 'node'}, el('span', {class: 'node-rank', text: '—'}), el('span', {class: 'node-key', text: k}),
            el('span', {class: 'node-addr', text: 'missing'})));
        for (let c = 0; c < this.cols; c++) tr.append(el('td', {class: 'slot'}, el('div', {class: 'cell ghost', text: '·'})));
        rows.push(tr);
      }
      const table = el('table', {class: 'wgrid'}, el('thead', {}, head), el('tbody', {}, rows));
      table.addEventListener('mousemove', (e) => {
        const cell = e.target.closest('.cell[data-n]');
        if (!cell) { this.hideTip(); return; }
        this.showTip(Number(cell.dataset.n), Number(cell.dataset.s), e.clientX, e.clientY);
      });
      table.addEventListener('mouseleave', () => this.hideTip());
      table.addEventListener('click', (e) => {
        const cell = e.target.closest('.cell[data-n]');
        if (cell) this.select(Number(cell.dataset.n), Number(cell.dataset.s));
      });
      fill(this.box, table);
    }

    cellEl(w, i, c) {
      const lease = leaseClass(w, this.ttl);
      const fill = this.by === 'role' ? `role-${this.roleIndex(w.role)}` : `lease-${lease} by-lease`;
      const sel = this.selected && this.selected[0] === i && this.selected[1] === c;
      return el('div', {class: `cell ${fill}${w.rank === null ? ' unranked' : ''}${sel ? ' selected' : ''}`,
        dataset: {n: i, s: c, rank: w.rank === null ? '' : w.rank}},
        w.rank === null ? '·' : String(w.rank), el('i', {class: `lease lease-${lease}`}));
    }

    // A canvas: big jobs, any size. Nodes flow left to right, each a run of its local ranks.
    renderCanvas() {
      if (!this.canvas) {
        this.canvas = el('canvas', {'aria-label': 'Workers by node and local rank'});
        this.canvas.addEventListener('mousemove', (e) => {
          const hit = this.hit(e);
          if (hit) this.showTip(hit[0], hit[1], e.clientX, e.clientY); else this.hideTip();
        });
        this.canvas.addEventListener('mouseleave', () => this.hideTip());
        this.canvas.addEventListener('click', (e) => { const hit = this.hit(e); if (hit) this.select(hit[0], hit[1]); });
      }
      if (this.box.firstChild !== this.canvas || this.box.childNodes.length !== 1) fill(this.box, this.canvas);
      this.draw();
    }

    palette() {
      if (this.colours) return this.colours;
      const cs = getComputedStyle(document.documentElement);
      const v = (name) => cs.getPropertyValue(name).trim();
      const c = {role: {}, lease: {}, empty: v('--cell-empty'), text: v('--faint'), sel: v('--text')};
      for (let i = 0; i < 8; i++) c.role[String(i)] = v(`--role-${i}`);
      c.role.none = v('--role-none');
      for (const [k] of LEASES) c.lease[k] = v(`--lease-${k}`);
      this.colours = c;
      return c;
    }

    layout(width) {
      const n = this.nodes.length, W = this.cols;
      const gutter = 52;
      const maxH = 960;   // about a screen: 10,000 workers fit at 9-11 px a cell on a 1,400 px wide page
      let g = null;
      for (const s of [16, 13, 11, 9, 7, 6, 5, 4, 3]) {
        const gap = s >= 6 ? 1 : 0.5;
        const pitch = s + gap;
        const nodeGap = W > 1 ? Math.max(3, Math.round(s / 2)) : 0;
        const colsPerNode = Math.max(1, Math.min(W, Math.floor((width - gutter) / pitch)));
        const linesPerNode = Math.ceil(W / colsPerNode);
        const nodeW = colsPerNode * pitch + nodeGap;
        const perLine = Math.max(1, Math.floor((width - gutter + nodeGap) / nodeW));
        const lineGap = W > 1 ? Math.max(2, Math.round(s / 3)) : 0;
        const bandH = linesPerNode * pitch + lineGap;
        const bands = Math.ceil(n / perLine);
        const height = bands * bandH;
        g = {s, gap, pitch, nodeGap, colsPerNode, linesPerNode, nodeW, perLine, lineGap, bandH, bands, height, gutter};
        if (height <= maxH) break;
      }
      return g;
    }

    draw() {
      const canvas = this.canvas;
      if (!canvas) return;
      const width = Math.max(320, this.box.clientWidth);
      const g = this.layout(width);
      this.geo = g;
      const dpr = window.devicePixelRatio || 1;
      const h = Math.max(g.height, g.pitch);
      canvas.width = Math.round(width * dpr);
      canvas.height = Math.round(h * dpr);
      canvas.style.width = `${width}px`;
      canvas.style.height = `${h}px`;
      const ctx = canvas.getContext('2d');
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, width, h);
      const pal = this.palette();
      const s = g.s, bar = this.by === 'role' && s >= 7 ? Math.max(2, Math.round(s / 4)) : 0;
      const roleOf = new Map();
      for (const [role, i] of this.roles) roleOf.set(role, pal.role[String(i % 8)]);
      // labels: the first node of each band, where there is room
      ctx.fillStyle = pal.text;
      ctx.font = `${Math.min(11, Math.max(9, s))}px ${getComputedStyle(document.body).getPropertyValue('--mono') || 'monospace'}`;
      ctx.textBaseline = 'middle';
      const every = Math.max(1, Math.ceil(14 / g.bandH));
      for (let b = 0; b < g.bands; b += every) {
        const n = this.nodes[b * g.perLine];
        const label = n.node_rank === null ? `${b * g.perLine}` : `#${n.node_rank}`;
        ctx.fillText(label, 0, b * g.bandH + Math.min(g.linesPerNode * g.pitch, s + 1) / 2);
      }
      for (let i = 0; i < this.nodes.length; i++) {
        const slots = this.slots[i];
        const x0 = g.gutter + (i % g.perLine) * g.nodeW;
        const y0 = Math.floor(i / g.perLine) * g.bandH;
        for (let c = 0; c < this.cols; c++) {
          const x = x0 + (c % g.colsPerNode) * g.pitch;
          const y = y0 + Math.floor(c / g.colsPerNode) * g.pitch;
          const w = slots[c];
          if (!w) { ctx.fillStyle = pal.empty; ctx.fillRect(x, y, s, s); continue; }
          const lease = pal.lease[leaseClass(w, this.ttl)];
          ctx.fillStyle = this.by === 'role' ? (w.role ? roleOf.get(w.role) || pal.role.none : pal.role.none) : lease;
          ctx.fillRect(x, y, s, s);
          if (bar) { ctx.fillStyle = lease; ctx.fillRect(x, y + s - bar, s, bar); }
        }
      }
      if (this.selected) {
        const [i, c] = this.selected;
        if (i < this.nodes.length) {
          const x = g.gutter + (i % g.perLine) * g.nodeW + (c % g.colsPerNode) * g.pitch;
          const y = Math.floor(i / g.perLine) * g.bandH + Math.floor(c / g.colsPerNode) * g.pitch;
          ctx.strokeStyle = pal.sel;
          ctx.lineWidth = 2;
          ctx.strokeRect(x - 1.5, y - 1.5, s + 3, s + 3);
        }
      }
    }

    hit(e) {
      const g = this.geo;
      if (!g) return null;
      const r = this.canvas.getBoundingClientRect();
      const x = e.clientX - r.left - g.gutter, y = e.clientY - r.top;
      if (x < 0 || y < 0) return null;
      const band = Math.floor(y / g.bandH), col = Math.floor(x / g.nodeW);
      if (col >= g.perLine) return null;
      const i = band * g.perLine + col;
      const inX = x - col * g.nodeW, inY = y - band * g.bandH;
      const cx = Math.floor(inX / g.pitch), cy = Math.floor(inY / g.pitch);
      if (cx >= g.colsPerNode || cy >= g.linesPerNode) return null;
      const c = cy * g.colsPerNode + cx;
      if (i >= this.nodes.length || c >= this.cols || !this.slots[i][c]) return null;
      return [i, c];
    }

    /** [label, value, swatch class or ''] of worker c of node i. */
    details(i, c) {
      const n = this.nodes[i], w = this.slots[i][c];
      return [
        ['node', n.node_key, ''], ['node rank', n.node_rank === null ? '— (not placed)' : String(n.node_rank), ''],
        ['address', (n.addresses || [n.address]).join(', '), ''], ['local rank', w.local_rank === null ? '—' : String(w.local_rank), ''],
        ['global rank', w.rank === null ? '— (not seated)' : String(w.rank), ''],
        ['role', w.role || '(none)', `role-${this.roleIndex(w.role)}`],
        ['lease', leaseText(w), `lease-${leaseClass(w, this.ttl)}`], ['worker id', w.worker_id, ''],
      ];
    }

    static value(v, swatch) {
      return el('dd', {}, swatch ? el('span', {class: `sw ${swatch}`}) : null, v);
    }

    showTip(i, c, x, y) {
      if (!this.slots[i] || !this.slots[i][c]) { this.hideTip(); return; }
      const tip = this.tip;
      fill(tip, el('dl', {}, this.details(i, c).map(([k, v, sw]) => [el('dt', {text: k}), WorkerGrid.value(v, sw)])));
      tip.hidden = false;
      const r = tip.getBoundingClientRect();
      const left = x + 14 + r.width > window.innerWidth ? x - 14 - r.width : x + 14;
      const top = y + 14 + r.height > window.innerHeight ? y - 14 - r.height : y + 14;
      tip.style.left = `${Math.max(4, left)}px`;
      tip.style.top = `${Math.max(4, top)}px`;
    }

    hideTip() { this.tip.hidden = true; }

    select(i, c) {
      this.selected = [i, c];
      this.selectedKey = [this.nodes[i].node_key, c];
      if (this.mode === 'canvas') this.draw(); else this.renderTable();
      this.showSelection();
    }

    /** The selected worker where it is now (a refresh may have reordered the nodes, or it left). */
    resolveSelection() {
      if (!this.selectedKey) return;
      const i = this.nodes.findIndex((n) => n.node_key === this.selectedKey[0]);
      this.selected = i >= 0 && this.slots[i][this.selectedKey[1]] ? [i, this.selectedKey[1]] : null;
    }

    showSelection() {
      if (!this.selected) {
        fill(this.selectionBox, el('span', {class: 'hint', text: this.nodes.length ? 'Hover a cell for its worker; click to keep it here.' : ''}));
        return;
      }
      const [i, c] = this.selected;
      fill(this.selectionBox, el('div', {class: 'selection-title', text: 'Selected worker'}),
        el('dl', {}, this.details(i, c).map(([k, v, sw]) => el('div', {}, el('dt', {text: k}), WorkerGrid.value(v, sw)))));
    }

    /** Finds a global rank (digits) or a node key (else): selects it; false when there is none. */
    find(q) {
      q = q.trim();
      if (!q) return true;
      for (let i = 0; i < this.nodes.length; i++) {
        const slots = this.slots[i];
        if (/^\d+$/.test(q)) {
          const c = slots.findIndex((w) => w && w.rank === Number(q));
          if (c >= 0) { this.select(i, c); this.reveal(i, c); return true; }
        } else if (this.nodes[i].node_key === q || this.nodes[i].node_key.includes(q)) {
          const c = slots.findIndex((w) => !!w);
          if (c >= 0) { this.select(i, c); this.reveal(i, c); return true; }
        }
      }
      return false;
    }

    reveal(i, c) {
      let target = null, y = 0;
      if (this.mode === 'table') target = this.box.querySelector(`.cell[data-n="${i}"][data-s="${c}"]`);
      else if (this.geo) { target = this.canvas; y = Math.floor(i / this.geo.perLine) * this.geo.bandH; }
      if (!target) return;
      const r = target.getBoundingClientRect();
      const top = r.top + window.scrollY + y;
      if (top < window.scrollY + 80 || top > window.scrollY + window.innerHeight - 80) {
        window.scrollTo({top: top - window.innerHeight / 3});
      }
    }
  }

  // ---- go --------------------------------------------------------------------

  const page = document.body.dataset.page;
  if (page === 'jobs') jobsPage();
  else if (page === 'job') jobPage();
})();
