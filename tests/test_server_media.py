"""Images in the server's chat messages (``image_url`` parts with base64 ``data:`` URIs),
through the official `openai` package, against what `specgguf run --image` generates with
the same tiny target, projector and drafter; bad images refused with a 400 naming the part,
before anything is decoded."""

from __future__ import annotations

import base64
import json
import re
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from specgguf.gguf.tinymedia import picture, png_bytes, write_mmproj, write_png
from specgguf.llama.media import MARKER

from .helpers import ServerProcess, run_cli
from .test_server import _loopback_only  # noqa: F401 (clients talk to 127.0.0.1 directly)

N_EMBD = 64  # the tiny target's (specgguf/gguf/tiny.py)
#: Drafting on, with a drafter that drafts on the tiny pair (tests/test_media.py)
SPEC = ["--drafter", "ngram", "--draft", "4", "-t", "1", "-c", "1024"]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def media(
    tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("server-media")
    write_mmproj(folder / "mmproj.gguf", N_EMBD)
    return {
        "target": tiny_models["target"],
        "mmproj": folder / "mmproj.gguf",
        "a": write_png(folder / "a.png", picture()),
        "b": write_png(folder / "b.png", picture(flip=True)),
        "c": write_png(folder / "c.png", picture()[::-1].copy()),  # (in one test only)
    }


@pytest.fixture(scope="module")
def server(media: dict[str, Path]) -> Iterator[ServerProcess]:
    with ServerProcess("-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                       *SPEC) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def data_uri(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image(path: Path) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": data_uri(path.read_bytes())}}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def run_text(media: dict[str, Path], prompt: str, *images: str, n: int = 48) -> str:
    """What `specgguf run` generates with the same files, settings and images."""
    args = [a for name in images for a in ("--image", str(media[name]))]
    res = run_cli("run", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  *SPEC, *args, "--temp", "0", "-n", str(n), "--ignore-eos", "--json",
                  prompt)  # fmt: skip
    assert res.returncode == 0, res.stderr.decode()
    return str(json.loads(res.stdout)["text"])


def chat(
    client: openai.OpenAI, messages: list[dict[str, Any]], *, stream: bool = False, n: int = 48
) -> Any:
    """The answer's text and its timings (streamed: the text put together)."""
    if not stream:
        r = client.chat.completions.create(model="tiny", messages=messages,
                                           **{**GREEDY, "max_tokens": n})  # type: ignore[arg-type]  # fmt: skip
        return r.choices[0].message.content, r.model_extra["timings"]  # type: ignore[index]
    chunks = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                            **GREEDY)  # type: ignore[arg-type]  # fmt: skip
    pieces, timings = [], None
    for c in chunks:
        if c.choices and c.choices[0].delta.content:
            pieces.append(c.choices[0].delta.content)
        timings = (c.model_extra or {}).get("timings") or timings
    return "".join(pieces), timings


# The content parts are joined by newlines (as text parts always were): run's prompt with
# the marker where the image part is gives the same conversation.
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_image_part_generates_what_run_does_with_the_image(
    client: openai.OpenAI, media: dict[str, Path], stream: bool
) -> None:
    got, timings = chat(client, [{"role": "user", "content": [image(media["a"]),
                                                              text("Describe")]}],
                        stream=stream)  # fmt: skip
    assert got == run_text(media, f"{MARKER}\nDescribe", "a")
    assert timings["predicted_n"] == 48 and timings["draft_n"] > 0  # drafting was on


def test_two_images_in_one_message_are_read_in_their_order(
    client: openai.OpenAI, media: dict[str, Path]
) -> None:
    parts = [text("Compare"), image(media["a"]), image(media["b"])]
    got, _ = chat(client, [{"role": "user", "content": parts}])
    assert got == run_text(media, f"Compare\n{MARKER}\n{MARKER}", "a", "b")
    swapped, _ = chat(client, [{"role": "user", "content": [parts[0], parts[2], parts[1]]}])
    assert swapped == run_text(media, f"Compare\n{MARKER}\n{MARKER}", "b", "a")


def test_image_requests_at_once_each_get_what_they_get_alone(
    server: ServerProcess, client: openai.OpenAI, media: dict[str, Path]
) -> None:
    # The server's parallel sequences (4 by default): three image requests and a text one
    # sent at once generate together (their images read between the batches of the
    # others), each answered as `run` answers it alone.
    asks = [([image(media["a"]), text("Describe")], (f"{MARKER}\nDescribe", "a")),
            ([image(media["b"]), text("Describe")], (f"{MARKER}\nDescribe", "b")),
            ([text("Compare"), image(media["a"]), image(media["b"])],
             (f"Compare\n{MARKER}\n{MARKER}", "a", "b")),
            ([text("Tell me about the quick fox")], ("Tell me about the quick fox",))]  # fmt: skip
    n = 900  # (most of the 1,024 positions: long enough to be seen running together)
    want = [run_text(media, *args, n=n) for _, args in asks]
    assert slots(server) == 4
    most = 0
    with ThreadPoolExecutor(len(asks)) as pool:
        runs = [pool.submit(chat, client, [{"role": "user", "content": c}], n=n)
                for c, _ in asks]  # fmt: skip
        while not all(r.done() for r in runs):
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            running = re.search(r"^specgguf_requests_running (\d+)", metrics, re.M)
            assert running is not None, metrics
            most = max(most, int(running[1]))
            time.sleep(0.005)
        got = [r.result() for r in runs]
    assert [text for text, _ in got] == want
    assert most >= 2  # (one at a time would never show two running)


def test_two_image_conversations_in_turn_each_keep_their_image(
    client: openai.OpenAI, media: dict[str, Path]
) -> None:
    # Their prompts share the template's beginning, above llama-server's slot similarity:
    # each still keeps a sequence of its own (the prompt cache keeps no images, so one
    # taken over would be read again at every turn).
    ask = {name: [{"role": "user", "content": [image(media[name]), text("What is in it?")]}]
           for name in ("a", "b")}  # fmt: skip
    for name in ("a", "b", "a", "b"):
        chat(client, ask[name], n=4)
    for name in ("a", "b"):
        _, t = chat(client, ask[name], n=4)
        assert t["prompt_n"] == 1 and t["cache_n"] > 16, (name, t)  # (its last token read)


def test_an_image_in_an_earlier_turn_is_kept_and_its_prompt_reused(
    client: openai.OpenAI, media: dict[str, Path]
) -> None:
    first = [{"role": "user", "content": [image(media["a"]), text("Describe")]}]
    answer, t1 = chat(client, first)
    later = [*first, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And the colours?"}]  # fmt: skip
    got, t2 = chat(client, later)
    # The first turn, image included, is read again from the cache: only the new turns are.
    assert t2["cache_n"] >= t1["prompt_n"] + t1["cache_n"] - 1, (t1, t2)
    # The same conversation with an image no other request sent in the first turn: read
    # from the image on (its placeholders are the same tokens as the first image's, whose
    # rows are not reused), and the answer is another.
    other = [{**first[0], "content": [image(media["c"]), text("Describe")]}, *later[1:]]
    got_other, t3 = chat(client, other)
    assert t3["cache_n"] < 16 < t3["prompt_n"], t3  # (the image's 16 rows read again)
    assert got_other != got


def test_a_text_conversation_is_kept_in_the_prompt_cache_across_an_image_request(
    client: openai.OpenAI, media: dict[str, Path]
) -> None:
    long = [{"role": "user", "content": "Tell me about " + "the quick brown fox " * 60}]
    _, t1 = chat(client, long)
    chat(client, [{"role": "user", "content": [image(media["a"]), text("Describe")]}])
    _, t2 = chat(client, long)  # (the text prompt came back from the RAM prompt cache)
    assert t2["cache_n"] >= t1["prompt_n"] + t1["cache_n"] - 1, (t1, t2)


def test_base64_as_tools_write_it_and_a_bare_url_string_are_read(
    client: openai.OpenAI, media: dict[str, Path]
) -> None:
    plain = base64.b64encode(media["a"].read_bytes()).decode()
    wrapped = "\n".join(plain[i : i + 76] for i in range(0, len(plain), 76))  # GNU base64
    url_safe = base64.urlsafe_b64encode(media["a"].read_bytes()).decode().rstrip("=")
    want, _ = chat(client, [{"role": "user", "content": [image(media["a"]), text("Describe")]}])
    for url in (f"data:image/png;base64,{wrapped}", f"data:image/png;base64,{url_safe}"):
        part = {"type": "image_url", "image_url": {"url": url}}
        assert chat(client, [{"role": "user", "content": [part, text("Describe")]}])[0] == want
    bare = {"type": "image_url", "image_url": f"data:image/png;base64,{plain}"}
    assert chat(client, [{"role": "user", "content": [bare, text("Describe")]}])[0] == want


def props(server: ServerProcess) -> dict[str, Any]:
    root = server.base_url.removesuffix("/v1")
    out: dict[str, Any] = httpx.get(f"{root}/props", timeout=10).json()
    return out


def slots(server: ServerProcess) -> int:
    """The server's sequences, as ``/props`` says (llama-server's ``total_slots``)."""
    return int(props(server)["total_slots"])


def says_it_reads_images(server: ServerProcess) -> bool:
    """What llama-server's web UI reads (``/props``) and its model list says (``capabilities``),
    each the same."""
    said = props(server)
    card = httpx.get(f"{server.base_url}/models", timeout=10).json()["data"][0]
    assert said["modalities"]["vision"] == ("multimodal" in card["capabilities"]), (said, card)
    assert said["default_generation_settings"]["n_ctx"] == 1024
    return bool(said["modalities"]["vision"])


def test_a_client_can_see_that_the_server_reads_images(server: ServerProcess) -> None:
    assert says_it_reads_images(server)


def post(server: ServerProcess, body: Any) -> httpx.Response:
    return httpx.post(f"{server.base_url}/chat/completions", content=json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip


def _wav() -> bytes:
    return b"RIFF" + struct.pack("<I", 36) + b"WAVEfmt " + bytes(24)


BAD: list[tuple[str, Any, str, str]] = [
    # (what, the part, the param named, words of the message)
    ("a web address", {"type": "image_url", "image_url": {"url": "http://10.0.0.1/a.png"}},
     "messages.0.content.0.image_url.url", "web address"),
    ("a file address", {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}},
     "messages.0.content.0.image_url.url", "not a data: URI"),
    ("not base64", {"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}},
     "messages.0.content.0.image_url.url", "not valid base64"),
    ("not in base64", {"type": "image_url", "image_url": {"url": "data:image/png,abc"}},
     "messages.0.content.0.image_url.url", "base64"),
    ("empty", {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
     "messages.0.content.0.image_url.url", "empty"),
    ("no image_url", {"type": "image_url"}, "messages.0.content.0.image_url", "needs its"),
    ("a corrupt PNG", {"type": "image_url",
                       "image_url": {"url": data_uri(png_bytes(picture())[:60])}},
     "messages.0.content.0", "messages.0.content.0"),
    ("not an image", {"type": "image_url", "image_url": {"url": data_uri(b"hello there")}},
     "messages.0.content.0", "PNG"),
    ("audio", {"type": "image_url", "image_url": {"url": data_uri(_wav(), "audio/wav")}},
     "messages.0.content.0", "audio"),
    ("20,000 x 20,000", {"type": "image_url", "image_url": {"url": data_uri(
        b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR"
        + struct.pack(">II", 20000, 20000) + bytes(5))}},
     "messages.0.content.0", "pixels"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "part", "param", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_images_get_400_naming_the_part(
    server: ServerProcess, what: str, part: Any, param: str, words: str
) -> None:
    r = post(server, {"messages": [{"role": "user", "content": [part, text("Describe")]}]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_images_outside_user_messages_and_stray_markers_get_400(
    server: ServerProcess, media: dict[str, Path]
) -> None:
    r = post(server, {"messages": [{"role": "system", "content": [image(media["a"])]},
                                   {"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages.0.content.0"
    # llama.cpp's marker typed anywhere in the conversation is text, images or not: each
    # request marks its images with a marker of its own (llama.cpp #21955)
    typed = [{"role": "system", "content": f"Say {MARKER} back"},
             {"role": "user", "content": [image(media["a"]), text(f"what {MARKER}")]}]  # fmt: skip
    r = post(server, {"messages": typed, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert post(server, {"messages": [{"role": "user", "content": MARKER}],
                         "max_tokens": 2}).status_code == 200  # fmt: skip


def test_images_that_do_not_fit_the_context_are_refused_before_they_are_encoded(
    server: ServerProcess, media: dict[str, Path]
) -> None:
    # 16 positions an image, n_ctx 1024: the 64th image fills the context; 2,000 images
    # would take seconds to encode, and are refused at the first that does not fit.
    parts = [image(media["a"])] * 2000 + [text("Describe")]
    t0 = time.monotonic()
    r = post(server, {"messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert time.monotonic() - t0 < 30


def test_without_a_projector_an_image_gets_400_and_deterministic_is_refused(
    media: dict[str, Path],
) -> None:
    with ServerProcess("-m", str(media["target"]), *SPEC, "--parallel", "1") as s:
        r = post(s, {"messages": [{"role": "user", "content": [image(media["a"])]}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages.0.content.0" and "mmproj" in err["message"], err
        assert not says_it_reads_images(s) and slots(s) == 1
    # a server whose every image request would be refused does not start
    res = run_cli("serve", "-m", str(media["target"]), "--mmproj", str(media["mmproj"]),
                  "--deterministic", "--port", "0", *SPEC)  # fmt: skip
    err = res.stderr.decode()
    assert res.returncode == 2 and "deterministic mode" in err and "Traceback" not in err, err


# -- addresses on hosts the operator allowed (--allow-remote-media) -----------------------


@pytest.fixture(scope="module")
def web(media: dict[str, Path]) -> Iterator[str]:
    """A web server on 127.0.0.1 with the picture (/a.png), a redirect to another host's
    address of it (/away: localhost, not allowed), and nothing else (404); its root URL."""
    import http.server
    import threading

    png = media["a"].read_bytes()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            port = self.server.server_address[1]
            if self.path == "/a.png":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                self.wfile.write(png)
            elif self.path == "/away":
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{port}/a.png")
                self.end_headers()
            else:
                self.send_error(404)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_images_at_addresses_are_fetched_from_allowed_hosts_only(
    media: dict[str, Path], web: str, client: openai.OpenAI
) -> None:
    host = web.removeprefix("http://")
    want, _ = chat(client, [{"role": "user", "content": [image(media["a"]), text("Describe")]}])

    def part(url: str) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            text("Describe")]}  # fmt: skip

    with ServerProcess("-m", str(media["target"]), "--mmproj", str(media["mmproj"]), *SPEC,
                       "--allow-remote-media", host) as s:  # fmt: skip
        remote = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        assert chat(remote, [part(f"{web}/a.png")])[0] == want
        for url, param, words in [
            (f"{web}/away", "messages.0.content.0", "not allowed"),  # redirected off the host
            (f"{web}/nothing", "messages.0.content.0", "HTTP 404"),
            ("http://127.0.0.2:9/a.png", "messages.0.content.0.image_url.url", "web address"),
        ]:
            r = post(s, {"messages": [part(url)]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and words in err["message"], err


def test_the_allowed_hosts_and_the_size_of_what_is_fetched(web: str) -> None:
    from specgguf.errors import MediaError
    from specgguf.server.remote import allowed, fetch_image

    host = web.removeprefix("http://")
    assert allowed(f"{web}/a.png", [host]) and allowed(f"{web}/a.png", ["127.0.0.1"])
    assert allowed("https://Images.Example:443/x", ["images.example"])
    assert not allowed("https://images.example:8443/x", ["images.example:443"])
    assert not allowed("ftp://images.example/x", ["images.example"])
    assert not allowed("http://images.example.evil/x", ["images.example"])
    assert not allowed("http://images.example:notaport/x", ["images.example"])
    assert fetch_image(f"{web}/a.png", "p", [host], 1 << 20)[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(MediaError, match="more than 10 bytes"):
        fetch_image(f"{web}/a.png", "p", [host], 10)


def test_a_server_that_read_images_keeps_its_other_prompts_at_shutdown(
    media: dict[str, Path], tmp_path: Path
) -> None:
    # --cache-dir: what the sequences hold goes to files at shutdown; the one holding an
    # image is left out (not kept in files yet), and the text prompts are written.
    folder = tmp_path / "prompts"
    s = ServerProcess("-m", str(media["target"]), "--mmproj", str(media["mmproj"]), *SPEC,
                      "--cache-dir", str(folder))  # fmt: skip
    with s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        chat(client, [{"role": "user", "content": "Tell me about " + "the quick fox " * 40}])
        chat(client, [{"role": "user", "content": [image(media["a"]), text("Describe")]}])
        assert s.stop() == 0, "".join(s.stderr_lines)
    err = "".join(s.stderr_lines)
    assert "1 prompt(s) saved" in err and "Traceback" not in err, err


def test_a_projector_closed_encodes_no_more(media: dict[str, Path]) -> None:
    from specgguf.errors import BackendError
    from specgguf.llama.backend import LlamaModel
    from specgguf.llama.media import Projector

    with LlamaModel(media["target"]) as model:
        p = Projector(media["mmproj"], model, n_threads=1)
        assert p.chunks(media["a"].read_bytes(), "a")
        p.close()  # (the server's shutdown, while a request's thread may still encode)
        with pytest.raises(BackendError, match="closed"):
            p.chunks(media["a"].read_bytes(), "a")


def test_m_rope_image_requests_at_once_each_get_what_they_get_alone(
    tiny_models: dict[str, Path], media: dict[str, Path], tmp_path: Path
) -> None:
    """A target with M-RoPE (Qwen2-VL's text model, Qwen2-VL's projector: an image's 16
    rows on 4 positions) on the server's parallel sequences: the sequences' positions
    in one batch are their own, each request answered as `run` answers it alone."""
    qwen = {**media, "target": tiny_models["qwen2vl"], "mmproj": tmp_path / "mmproj.gguf"}
    write_mmproj(qwen["mmproj"], N_EMBD, patch_size=4, projector="qwen2vl_merger")
    asks = [([image(media["a"]), text("Describe")], (f"{MARKER}\nDescribe", "a")),
            ([text("Compare"), image(media["b"]), image(media["a"])],
             (f"Compare\n{MARKER}\n{MARKER}", "b", "a")),
            ([text("Tell me about the quick fox")], ("Tell me about the quick fox",))]  # fmt: skip
    n = 400
    want = [run_text(qwen, *args, n=n) for _, args in asks]
    with ServerProcess("-m", str(qwen["target"]), "--mmproj", str(qwen["mmproj"]), *SPEC) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        with ThreadPoolExecutor(len(asks)) as pool:
            runs = [pool.submit(chat, client, [{"role": "user", "content": c}], n=n)
                    for c, _ in asks]  # fmt: skip
            got = [r.result()[0] for r in runs]
    assert got == want


def test_a_draft_model_reads_the_images_rows_on_parallel_sequences(
    tiny_models: dict[str, Path], media: dict[str, Path]
) -> None:
    """A draft model as wide as the target (here the target's own weights) reads each
    request's image rows in its own sequence, beside the others: every answer is `run`'s,
    and the drafts after the images are accepted (with the placeholders most were not)."""
    pair = {**media, "draft": tiny_models["draft-identical"]}
    spec = ["-md", str(pair["draft"]), "--drafter", "model", "--draft", "4", "-t", "1",
            "-c", "1024"]  # fmt: skip
    asks = [[image(media["a"]), text("Describe")], [image(media["b"]), text("Describe")],
            [text("Compare"), image(media["b"]), image(media["a"])]]  # fmt: skip
    with ServerProcess("-m", str(pair["target"]), "--mmproj", str(pair["mmproj"]), *spec) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        with ThreadPoolExecutor(len(asks)) as pool:
            runs = [pool.submit(chat, client, [{"role": "user", "content": c}], n=64)
                    for c in asks]  # fmt: skip
            got = [r.result() for r in runs]
    prompts = [(f"{MARKER}\nDescribe", "a"), (f"{MARKER}\nDescribe", "b"),
               (f"Compare\n{MARKER}\n{MARKER}", "b", "a")]  # fmt: skip
    for (answer, timings), args in zip(got, prompts, strict=True):
        res = run_cli("run", "-m", str(pair["target"]), "--mmproj", str(pair["mmproj"]),
                      "--image", str(media[args[1]]), *(["--image", str(media[args[2]])]
                                                         if len(args) > 2 else []),
                      "--drafter", "none", "-t", "1", "-c", "1024", "--temp", "0", "-n", "64",
                      "--ignore-eos", "--json", args[0])  # fmt: skip
        assert res.returncode == 0, res.stderr.decode()
        assert answer == json.loads(res.stdout)["text"]
        assert timings["draft_n"] > 0 and timings["draft_n_accepted"] >= 0.75 * timings["draft_n"]
