"""Who may use Chat-E, and how many may wait: ``--auth`` (Gradio's login), the API key, the bounded queue, and the
warning for a server others can reach with neither. Real servers in subprocesses, driven by gradio_client and httpx."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest
from gradio_client.exceptions import AuthenticationError
from gradio_client.utils import QueueError

from chat_e.data.messages import message_text
from chat_e.http.guard import BUSY, NEEDS_KEY, WRONG_KEY

from ..conftest import ROOT, free_port, launch_env
from .support import ChatEServer, chat_e_cmd, gradio_client, serving

USER, PASSWORD, KEY = "alice", "wonder:land", "k3y-for-programs"
#: one reply that keeps a worker busy for a while: 10 beams, the tiny model's whole window
SLOW = ("free", "", 10, False, 1.0, 1.0, 127, 127)


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    """Side by side: a login server (``--auth``, and the API key from the environment) that answers one reply at a
    time with room for one more in its queue, and a server with an API key (the flag) only."""
    logs = tmp_path_factory.mktemp("chat-e-access")
    started = [
        ChatEServer(
            tiny_model_dir,
            logs / "login.log",
            *("--auth", f"{USER}:{PASSWORD}", "--concurrency", "1", "--max_queue", "1"),
            api_key=KEY,
        ),
        ChatEServer(tiny_model_dir, logs / "keyed.log", "--api_key", KEY),
    ]
    started[1].api_key = KEY  # the readiness probe and clients send it
    with serving(*started) as ready:
        yield ready


@pytest.fixture(scope="module")
def login(servers):
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers):
    return servers[1]


def anonymous(server, **kwargs):
    return gradio_client(server.url, **kwargs)


def post_chat(server, headers=None) -> httpx.Response:
    return httpx.post(
        f"{server.url}gradio_api/call/chat", json={"data": ["hi", [], "free", ""]}, headers=headers, timeout=60
    )


def test_login_refuses_without_credentials_and_answers_with_them(login):
    with pytest.raises(AuthenticationError, match="credentials were not provided"):
        anonymous(login)
    with pytest.raises(ValueError, match="Could not login"):
        anonymous(login, auth=(USER, "wrong"))
    assert post_chat(login).status_code == 401  # the endpoint itself, not only the client's first page
    reply = anonymous(login, auth=(USER, PASSWORD)).predict("hi", [], "free", "", api_name="/chat")
    assert reply
    # the API key lets a program in without the password; a wrong key is refused, with what to send
    assert anonymous(login, headers={"Authorization": f"Bearer {KEY}"}).predict("hi", [], "free", "", api_name="/chat")
    refused = post_chat(login, {"Authorization": "Bearer nope"})
    assert (refused.status_code, refused.json()["detail"]) == (401, WRONG_KEY)
    # the login page itself is open, and says nothing of the API (Gradio puts the schema of every endpoint in it);
    # once logged in (here: by the key) the app's page carries it
    page = httpx.get(login.url, timeout=30)
    assert page.status_code == 200 and '"auth_required":true' in page.text
    assert "window.gradio_api_info = null;</script>" in page.text and '"/chat"' not in page.text
    app_page = httpx.get(login.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    assert '"auth_required":true' not in app_page and '"/chat":{"parameters"' in app_page


def test_api_key_alone_guards_every_request(keyed):
    with pytest.raises(AuthenticationError, match="credentials were not provided"):
        anonymous(keyed)
    for headers, detail in [(None, NEEDS_KEY), ({"Authorization": f"Bearer {KEY}x"}, WRONG_KEY)]:
        refused = post_chat(keyed, headers)
        assert (refused.status_code, refused.json()["detail"]) == (401, detail)
        assert httpx.get(keyed.url, headers=headers, timeout=30).status_code == 401  # the page too
    client = anonymous(keyed, headers={"Authorization": f"Bearer {KEY}"})
    assert client.predict("hi", [], "free", "", api_name="/chat")
    assert post_chat(keyed, {"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_without_admin_the_train_page_and_its_endpoints_do_not_exist(login, keyed):
    """No --admin: nothing is served under /admin, to a logged-in user or a program with the key alike."""
    user = anonymous(login, auth=(USER, PASSWORD))
    assert "/start" not in str(user.view_api(print_info=False, return_format="dict"))
    for server, headers in ((keyed, {"Authorization": f"Bearer {KEY}"}), (login, {"Authorization": f"Bearer {KEY}"})):
        for path in ("admin/", "admin/config", "admin/gradio_api/info", "admin/gradio_api/call/start"):
            answer = httpx.get(f"{server.url}{path}", headers=headers, timeout=30)
            assert answer.status_code == 404, (path, answer.status_code)


def test_a_full_queue_answers_busy_and_recovers(login):
    """One reply at a time and one waiting: further requests are told to try again, none is lost or left hanging."""
    chat = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    client = login.client()  # gradio_client's callers get its own "try again" error; the accepted ones their replies
    jobs = [client.submit(chat, *SLOW, api_name="/respond") for _ in range(6)]
    outcomes = []
    for job in jobs:
        try:
            outcomes.append(bool(message_text(job.result(timeout=120)[-1]["content"])))
        except QueueError as err:
            assert "Please try again" in str(err)
            outcomes.append("busy")
    assert "busy" in outcomes and True in outcomes and False not in outcomes, outcomes
    # over HTTP, the answer says what happened, and when to come back
    url, headers = f"{login.url}gradio_api/call/respond", {"Authorization": f"Bearer {KEY}"}
    answers = [httpx.post(url, json={"data": [chat, *SLOW]}, headers=headers, timeout=60) for _ in range(4)]
    statuses = [r.status_code for r in answers]
    assert statuses.count(200) >= 1 and statuses.count(503) >= 1, statuses
    assert all(r.json()["detail"] == BUSY and r.headers["retry-after"] for r in answers if r.status_code == 503)
    deadline = time.monotonic() + 120  # the queue drains, and then a request is answered again
    while True:
        try:
            assert client.predict("hi again", [], "free", "", api_name="/chat")
            break
        except QueueError:
            assert time.monotonic() < deadline
            time.sleep(1)
    assert login.alive()


@pytest.mark.parametrize(
    "extra, env, warned",
    [
        (("--host", "0.0.0.0"), {}, True),
        (("--host", "0.0.0.0", "--auth", "a:b"), {}, False),
        (("--host", "0.0.0.0"), {"CHAT_E_API_KEY": "k"}, False),
        (("--host", "127.0.0.1"), {}, False),
    ],
    ids=["exposed", "login", "api-key", "loopback"],
)
def test_exposed_without_auth_or_key_warns_loudly(tmp_path, extra, env, warned):
    """The warning comes before the model is loaded (here a missing one, so nothing is ever served)."""
    cmd = chat_e_cmd(tmp_path / "missing", free_port(), *extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(**env), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "chat-e: error:" in proc.stderr
    text = "--host 0.0.0.0 serves beyond this machine, and Chat-E has neither --auth nor --api_key"
    assert (f"chat-e: WARNING: {text}" in proc.stderr) == warned  # on stderr ...
    assert (f"WARNING chat-e: {text}" in proc.stderr) == warned  # ... and in the log


@pytest.mark.parametrize(
    "extra, error",
    [
        (("--auth", "alice"), "--auth takes USER:PASSWORD, both non-empty"),
        (("--max_body_bytes", "1000"), "--max_body_bytes 1,000 is too small for a request within the other limits"),
        (("--max_queue", "0"), "--max_queue must be at least 1 (got 0)."),
        (("--share",), "--share is not supported: Chat-E serves its UI and API on one app"),
        (("--admin", "op"), "--admin takes USER:PASSWORD, both non-empty"),
        (("--admin", "op:pw", "--no_feedback"), "--admin trains on the feedback database: drop --no_feedback"),
    ],
    ids=["auth", "body", "queue", "share", "admin", "admin-without-feedback"],
)
def test_bad_access_flags_are_refused_with_the_fix(tmp_path, extra, error):
    proc = subprocess.run(
        chat_e_cmd(tmp_path / "missing", free_port(), *extra),
        cwd=ROOT,
        env=launch_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and error in proc.stderr and "Traceback" not in proc.stderr


def test_the_flag_checks_run_before_torch_and_transformers_are_imported():
    """What the refusals above answer comes from chat-e's own modules: they import neither torch nor transformers
    (seconds of start-up), which the server imports once the flags and the model directory are checked."""
    code = "import sys, chat_e.__main__; print(sorted(m for m in ('torch', 'transformers', 'gradio') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=launch_env(), capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.split() == ["[]"], proc.stderr[-2000:]
