"""No web page may drive the local server (issue 54, item 1): the ``Host``, ``Origin`` and
content-type checks of :mod:`specgguf.server.guard` and CORS only when asked for, through
the application over a scripted engine (no model), as a browser and a DNS-rebinding page
would send them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from .helpers import run_cli
from .test_server_structured import USER, ScriptedEngine, pieces_of

BODY = json.dumps({"messages": USER, "max_tokens": 2}).encode()
JSON = {"Content-Type": "application/json"}


def client_of(**settings: Any) -> Iterator[Any]:
    from starlette.testclient import TestClient

    from specgguf.server.app import ServerSettings, create_app

    engine = ScriptedEngine()
    engine.script = pieces_of("Hi there", 2)
    app = create_app(engine, ServerSettings(model_id="fake", **settings))  # type: ignore[arg-type]
    with TestClient(app, base_url="http://127.0.0.1:8080") as client:
        yield client
    app.state.scheduler.join(5)


@pytest.fixture
def client() -> Iterator[Any]:
    yield from client_of()


def chat(client: Any, headers: dict[str, str]) -> Any:
    return client.post("/v1/chat/completions", content=BODY, headers=headers)


def test_a_simple_cross_origin_post_is_refused_before_it_generates(client: Any) -> None:
    # text/plain and form bodies are what a page sends cross-origin without asking first
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None):
        r = chat(client, {"Content-Type": ctype} if ctype else {})
        err = r.json()["error"]
        assert r.status_code == 415 and err["code"] == "unsupported_media_type", r.text
        assert "Content-Type: application/json" in err["message"]
    r = chat(client, {"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hi there"


def test_a_rebound_host_name_is_refused(client: Any) -> None:
    for host in ("attacker.example:8080", "attacker.example", "localhost.attacker.example"):
        for r in (client.get("/v1/models", headers={"Host": host}),
                  chat(client, {**JSON, "Host": host}),
                  client.get("/health", headers={"Host": host})):  # fmt: skip
            assert r.status_code == 403, (host, r.text)
            assert r.json()["error"]["code"] == "host_not_allowed"
    for host in ("localhost:8080", "127.0.0.1:8080", "[::1]:8080", "10.0.0.5", "app.localhost:1"):
        assert client.get("/health", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_names_and_names_under_a_dot() -> None:
    for client in client_of(allowed_hosts=("box.lan", ".home.arpa")):
        ok = ("box.lan:8080", "BOX.LAN", "a.home.arpa", "home.arpa")
        for host in ok:
            assert client.get("/health", headers={"Host": host}).status_code == 200, host
        for host in ("x.box.lan", "box.lan.evil", "evilhome.arpa"):
            assert client.get("/v1/models", headers={"Host": host}).status_code == 403, host


def test_a_page_of_another_origin_is_refused_and_cors_is_off(client: Any) -> None:
    r = chat(client, {**JSON, "Origin": "https://evil.example"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert client.get("/v1/models", headers={"Origin": "null"}).status_code == 403
    # its own origin (a same-origin POST carries one) is let in, without CORS headers
    r = chat(client, {**JSON, "Origin": "http://127.0.0.1:8080"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    pre = client.options(
        "/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers


def test_cors_origins_let_those_pages_in_only() -> None:
    ui = "http://localhost:3000"
    for client in client_of(cors_origins=(ui,)):
        pre = client.options("/v1/chat/completions", headers={
            "Origin": ui, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization"})  # fmt: skip
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ui
        r = chat(client, {**JSON, "Origin": ui})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        assert chat(client, {**JSON, "Origin": "http://localhost:3001"}).status_code == 403


def test_cors_origins_are_matched_as_browsers_write_them_with_any_request_header() -> None:
    # a trailing slash or capitals in the flag (the browser sends neither), and the
    # openai JS client's own headers in the preflight
    for client in client_of(cors_origins=("http://LocalHost:3000/",)):
        ui = "http://localhost:3000"
        pre = client.options("/v1/chat/completions", headers={
            "Origin": ui, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,x-stainless-os,x-stainless-lang",
        })  # fmt: skip
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ui
        r = chat(client, {**JSON, "Origin": ui})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        # a refusal an allowed page sees carries CORS headers: it can read why
        r = chat(client, {"Content-Type": "text/plain", "Origin": ui})
        assert r.status_code == 415 and r.headers["access-control-allow-origin"] == ui


def test_a_connection_over_the_network_is_not_held_to_the_host_check() -> None:
    # As Ollama: a container, a proxy or another machine reaches a server bound to a
    # network address by names of their own (a compose service, a pod IP's name); a
    # rebound name leads to loopback. --allowed-hosts holds every connection to it.
    from starlette.testclient import TestClient

    from specgguf.server.app import ServerSettings, create_app

    for allowed, status in (((), 200), (("box.lan:8080",), 403), (("*",), 200)):
        app = create_app(ScriptedEngine(), ServerSettings(model_id="f", allowed_hosts=allowed))  # type: ignore[arg-type]
        with TestClient(app, base_url="http://10.1.2.3:8080") as c:
            assert c.get("/health", headers={"Host": "specgguf:8080"}).status_code == status
            # (a port, in the request or in the flag, is no part of the name)
            assert c.get("/health", headers={"Host": "box.lan:9"}).status_code == 200
        app.state.scheduler.join(5)


def test_cors_origins_localhost_lets_in_pages_on_this_machine_only() -> None:
    for client in client_of(cors_origins=("localhost",)):
        for ui in ("http://localhost:3000", "http://127.0.0.1:5173", "https://[::1]"):
            r = chat(client, {**JSON, "Origin": ui})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ui
        for other in ("http://localhost.evil.example", "http://10.0.0.2:3000"):
            assert chat(client, {**JSON, "Origin": other}).status_code == 403


def test_the_api_key_is_still_asked_of_an_allowed_page() -> None:
    ui = "http://localhost:3000"
    for client in client_of(cors_origins=("*",), api_key="k"):
        assert chat(client, {**JSON, "Origin": ui}).status_code == 401
        r = chat(client, {**JSON, "Origin": ui, "Authorization": "Bearer k"})
        assert r.status_code == 200


def test_cors_for_every_origin_needs_an_api_key() -> None:
    res = run_cli("serve", "-m", "none.gguf", "--cors-origins", "http://a.example, *")
    assert res.returncode == 2 and b"--cors-origins '*'" in res.stderr
