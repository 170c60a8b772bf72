"""Stored responses (OpenAI's Responses API as vLLM serves it) live on the engine that made
them: the proxy sends what names one (``previous_response_id``, ``/v1/responses/{id}``,
``.../cancel``, ``.../input_items``, ``DELETE``) to that engine, learns ids from the answers
(whole or streamed), looks an unknown id up on each engine in turn, and says which engine
is down when the holder is.

The engines are loopback HTTP servers that keep responses in memory as vLLM does (a kvwire
engine does not serve the Responses API); their event streams are real kvwire engines'.
Routing is round robin, so without the pinning every other follow-up would reach the
engine that does not hold the response and get its 404."""

from __future__ import annotations

import json
import re
import socket
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st
from test_proxy import TIMEOUT, Stack, _LoopbackServer, make_stack, wait_for  # noqa: F401

from kvwire.proxy.responses import ResponseOwners, addressed, chat_request
from kvwire.routing.policy import RoundRobinPolicy
from kvwire.tokenize import load_tokenizer
from kvwire.tokenize.content import as_engine_messages, as_engine_tools, engine_template_kwargs

_ITEM = re.compile(r"^/v1/responses/([^/?]+)(/cancel|/input_items)?(?:\?(.*))?$")


class _ResponseStore(_LoopbackServer):
    """An engine's Responses API with vLLM's store: responses it made, by id; a
    ``previous_response_id`` or an id it does not hold gets vLLM's 404."""

    def __init__(self) -> None:
        store = self
        self.release = threading.Event()
        self.held: dict[str, dict] = {}
        self.seen: list[tuple[str, str]] = []  # (method, path with query)
        self.conns: list[socket.socket] = []

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                store.conns.append(self.connection)

            def _json(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _missing(self, rid: str) -> None:
                self._json(404, {"error": {"message": f"Response with id '{rid}' not found.",
                                           "type": "NotFoundError", "param": None,
                                           "code": 404}})

            def _sse(self, events: list[dict]) -> None:
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                for ev in events:
                    data = f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n".encode()
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def _body(self) -> dict:
                n = int(self.headers.get("content-length", 0))
                return json.loads(self.rfile.read(n)) if n else {}

            def _item(self) -> tuple[str, str, str] | None:
                m = _ITEM.match(self.path)
                return (m.group(1), m.group(2) or "", m.group(3) or "") if m else None

            def do_GET(self) -> None:
                store.seen.append(("GET", self.path))
                if self.path == "/v1/models":
                    return self._json(200, {"object": "list", "data": [
                        {"id": "m", "object": "model", "parent": None}]})
                if self.path == "/health":
                    return self._json(200, {})
                item = self._item()
                if item is None:
                    return self._json(404, {})
                rid, tail, query = item
                if rid not in store.held:
                    return self._missing(rid)
                if tail == "/input_items":
                    return self._json(200, {"object": "list", "data": [
                        {"type": "message", "role": "user",
                         "content": store.held[rid]["input"]}]})
                if "stream=true" in query:
                    return self._sse([{"type": "response.completed",
                                       "response": store.held[rid]}])
                self._json(200, store.held[rid])

            def do_DELETE(self) -> None:
                store.seen.append(("DELETE", self.path))
                item = self._item()
                rid = item[0] if item else ""
                if store.held.pop(rid, None) is None:
                    return self._missing(rid)
                self._json(200, {"id": rid, "object": "response", "deleted": True})

            def do_POST(self) -> None:
                store.seen.append(("POST", self.path))
                body = self._body()
                item = self._item()
                if item is not None:  # .../cancel
                    rid = item[0]
                    if rid not in store.held:
                        return self._missing(rid)
                    store.held[rid]["status"] = "cancelled"
                    return self._json(200, store.held[rid])
                prev = body.get("previous_response_id")
                if prev is not None and prev not in store.held:
                    return self._missing(prev)
                rid = f"resp_{uuid.uuid4().hex}"
                resp = {"id": rid, "object": "response", "status": "completed",
                        "model": body.get("model"), "previous_response_id": prev,
                        "input": body.get("input"),
                        "output": [{"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                                    "content": [{"type": "output_text", "text": "ok"}]}]}
                store.held[rid] = resp
                if body.get("stream"):
                    return self._sse([
                        {"type": "response.created", "sequence_number": 0,
                         "response": dict(resp, status="in_progress", output=[])},
                        {"type": "response.output_text.delta", "delta": "ok"},
                        {"type": "response.completed", "response": resp}])
                self._json(200, resp)

            def log_message(self, *a: Any) -> None:
                pass

        self._serve(H)

    def close(self) -> None:
        """Gone for good: the listener and every kept-alive connection (the proxy's pool
        holds some), as when the engine's process dies."""
        super().close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _create(c: httpx.Client, prev: str | None = None, stream: bool = False
            ) -> tuple[str, str]:
    """(the new response's id, the engine that answered)."""
    body: dict[str, Any] = {"model": "m", "input": "hi"}
    if prev is not None:
        body["previous_response_id"] = prev
    if not stream:
        r = c.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        return r.json()["id"], r.headers["x-kvwire-engine"]
    body["stream"] = True
    with c.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(x[5:]) for x in r.iter_lines() if x.startswith("data:")]
        return events[0]["response"]["id"], r.headers["x-kvwire-engine"]


def test_what_names_a_stored_response_goes_to_the_engine_that_holds_it(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    a, b = _ResponseStore(), _ResponseStore()
    try:
        s = make_stack(2, policy=RoundRobinPolicy(), urls=[a.url, b.url])
        store = {"e0": a, "e1": b}
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            # a conversation: each turn continues the last, whole or streamed, and every
            # turn lands on the engine that made the first (round robin would alternate)
            rid, eng = _create(c)
            for i in range(6):
                rid, e = _create(c, prev=rid, stream=i % 2 == 1)
                assert e == eng and rid in store[eng].held
            assert s.proxy.owners.get(rid) == eng
            other = "e1" if eng == "e0" else "e0"
            assert not any(p.startswith("/v1/responses") for _, p in store[other].seen)

            # the id-addressed paths, query string included, reach the holder
            r = c.get(f"/v1/responses/{rid}")
            assert r.status_code == 200 and r.json()["id"] == rid
            assert r.headers["x-kvwire-engine"] == eng
            r = c.get(f"/v1/responses/{rid}/input_items")
            assert r.status_code == 200 and r.json()["data"][0]["content"] == "hi"
            with c.stream("GET", f"/v1/responses/{rid}?stream=true") as r:
                assert r.status_code == 200
                assert r.headers["content-type"].startswith("text/event-stream")
                assert any("response.completed" in x for x in r.iter_lines())
            assert ("GET", f"/v1/responses/{rid}?stream=true") in store[eng].seen
            r = c.post(f"/v1/responses/{rid}/cancel")
            assert r.status_code == 200 and r.json()["status"] == "cancelled"

            # a new conversation may start on the other engine: it is followed there
            rid2, eng2 = _create(c)
            if eng2 == eng:
                rid2, eng2 = _create(c)
            assert eng2 == other
            assert _create(c, prev=rid2)[1] == other

            # the proxy forgot every id (a restart): an id-addressed request looks on
            # each engine in turn, answers from the holder and remembers it
            s.proxy.owners = ResponseOwners()
            looked = s.proxy.counts["responses_looked_up"]
            r = c.get(f"/v1/responses/{rid2}")
            assert r.status_code == 200 and r.headers["x-kvwire-engine"] == other
            assert s.proxy.counts["responses_looked_up"] == looked + 1
            assert s.proxy.owners.get(rid2) == other
            # ... and so does a previous_response_id it does not know
            new, e = _create(c, prev=rid)
            assert e == eng and new in store[eng].held

            # deleted: forgotten, and then no engine holds it
            r = c.delete(f"/v1/responses/{rid}")
            assert r.status_code == 200 and r.json()["deleted"] is True
            assert s.proxy.owners.get(rid) is None
            r = c.get(f"/v1/responses/{rid}")
            assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
            r = c.post("/v1/responses", json={"model": "m", "input": "x",
                                               "previous_response_id": "resp_nobody"})
            assert r.status_code == 404, r.text

            # paths the proxy refuses itself, in OpenAI's error object
            for method, path, status in (("GET", "/v1/responses/", 404),
                                         ("GET", f"/v1/responses/{rid2}/bogus", 404),
                                         ("PUT", f"/v1/responses/{rid2}", 405)):
                r = c.request(method, path)
                assert r.status_code == status and "error" in r.json(), (path, r.text)
                assert "x-kvwire-engine" not in r.headers

            # the holder goes away: its responses' requests fail with its name, and are
            # never sent to the engine that does not hold them
            def asked(x: _ResponseStore) -> int:
                return sum(p.startswith("/v1/responses") for _, p in x.seen)

            n = asked(store[eng])
            store[other].close()
            r = c.post("/v1/responses", json={"model": "m", "input": "x",
                                               "previous_response_id": rid2})
            # (502 if this request finds it gone, 503 if a health probe did first)
            assert r.status_code in (502, 503) and other in r.json()["error"]["message"], r.text
            wait_for(lambda: not s.proxy.links[other].breaker.up, "the holder marked down")
            r = c.get(f"/v1/responses/{rid2}")
            assert r.status_code == 503, r.text
            msg = r.json()["error"]["message"]
            assert other in msg and rid2 in msg and "down" in msg
            assert asked(store[eng]) == n
            # every engine down, the id unknown: nowhere to look, said so
            store[eng].close()
            s.proxy.owners = ResponseOwners()
            wait_for(lambda: not any(lk.breaker.up for lk in s.proxy.links.values()),
                     "both engines marked down")
            r = c.get(f"/v1/responses/{rid2}")
            assert r.status_code == 503 and "no engine is available" in r.text, r.text
        wait_for(lambda: s.loads() == {}, "every reservation released")
        assert all(s.proxy.in_flight[n] == 0 for n in ("e0", "e1"))
    finally:
        a.close()
        b.close()


def test_owners_table_is_bounded_and_least_recently_used_goes_first() -> None:
    t = ResponseOwners(capacity=3)
    for i in range(3):
        t.learn(f"resp_{i}", "e0")
    assert t.get("resp_0") == "e0"  # used: now the most recent
    t.learn("resp_3", "e1")
    assert t.get("resp_1") is None and t.get("resp_0") == "e0" and len(t) == 3
    assert t.forgotten == 1
    t.forget("resp_0")
    assert t.get("resp_0") is None and len(t) == 2
    off = ResponseOwners(capacity=0)
    off.learn("resp_x", "e0")
    assert off.get("resp_x") is None and len(off) == 0


def test_learn_from_takes_the_first_response_id() -> None:
    t = ResponseOwners()
    created = (b'event: response.created\ndata: {"type":"response.created","sequence_number"'
               b':0,"response":{"id": "resp_abc","output":[{"id":"msg_1"}]}}\n\n')
    assert t.learn_from(created, "e1") and t.get("resp_abc") == "e1"
    assert not t.learn_from(b'{"id":"msg_1","object":"list"}', "e0")


@given(st.binary(max_size=80))
def test_addressed_parses_only_its_three_forms(tail: bytes) -> None:
    rid = addressed(b"/v1/responses/" + tail)
    assert rid is not None  # under the prefix: an id, or "" for a form it does not serve
    if rid:
        assert b"/v1/responses/" + rid.encode() + tail[len(rid):] == b"/v1/responses/" + tail
        assert tail[len(rid):] in (b"", b"/cancel", b"/input_items")
    assert addressed(b"/v1/responsesx/" + tail) is None
    assert addressed(b"/v1/responses") is None


# ------------------------------------------------------------------ routed by the cache


def test_chat_request_renders_a_response_request_as_vllm_does() -> None:
    """instructions -> system; a string input -> the user's message; items as vLLM maps
    them: text parts kept as parts, a reasoning item, an output message and the function
    calls after it merged into ONE assistant turn (as vLLM shows the template), outputs as
    tool turns; function tools in the chat shape; anything else -> None (by load)."""
    assert chat_request(None, "hi") == ([{"role": "user", "content": "hi"}], None,
                                        False, None)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    user = {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                        {"type": "input_text", "text": "b"}]}
    items = [
        user,
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "r"}]},
        {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "42"},
    ]
    conv = chat_request("be terse", items, [tool], {"effort": "low"})
    assert conv is not None
    call = {"id": "call_1", "function": {"name": "f", "arguments": "{}"}, "type": "function"}
    assert conv.messages == [
        {"role": "system", "content": "be terse"},
        user,
        {"role": "assistant", "reasoning": "r", "content": "c",
         "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"}]
    assert conv.tools == [{"type": "function", "function": {
        "name": "f", "description": None, "parameters": {"type": "object"}}}]
    assert (conv.continue_final_message, conv.reasoning_effort) == (False, "low")
    assert items[0] is user and "tool_calls" not in items[2]  # the client's items untouched
    # handed to a template that takes strings (Qwen3's), as vLLM does: the parts joined
    assert as_engine_messages(conv.messages, "string")[1] == {"role": "user", "content": "a\nb"}
    partial = {"type": "message", "role": "assistant", "status": "in_progress",
               "content": [{"type": "output_text", "text": "Once"}]}
    assert chat_request(None, [user, partial]).continue_final_message
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    for instructions, input_, tools_ in (
            (None, [image], None), (None, [], None), (None, None, None), (3, "hi", None),
            (None, "hi", [{"type": "function"}]), (None, "hi", "f"),
            (None, [{"type": "item_reference", "id": "x"}], None),
            (None, [{"type": "reasoning", "id": "r", "summary": [],
                     "encrypted_content": "xx"}], None),
            (None, [{"type": "function_call", "call_id": "c", "name": "f",
                     "arguments": {"a": 1}}], None),
            (None, [{"content": "no role"}], None)):
        assert chat_request(instructions, input_, tools_) is None, (instructions, input_)


#: Responses requests, each compared with what vLLM 0.33 makes of it.
_RESPONSES = [
    {"input": "hi", "instructions": "be terse"},
    {"input": [{"role": "user", "content": "q"},
               {"type": "reasoning", "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "S"}],
                "content": [{"type": "reasoning_text", "text": "R"}]},
               {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "c", "annotations": []}]},
               {"type": "function_call", "call_id": "call_1", "name": "f",
                "arguments": '{"x": 1}'},
               {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{}"},
               {"type": "function_call_output", "call_id": "call_1", "output": "42"},
               {"role": "assistant", "content": "plain"},
               {"role": "user", "content": "more"}],
     "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"},
                "strict": True, "defer_loading": True},
               {"type": "function", "name": "g", "description": "G", "parameters": None}],
     "reasoning": {"effort": "low"}},
    # only a summary; then two output messages in a row; then a call with no turn before
    {"input": [{"role": "developer", "content": "d"},
               {"type": "reasoning", "id": "rs_2",
                "summary": [{"type": "summary_text", "text": "only summary"}]},
               {"type": "message", "id": "m1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "one", "annotations": []},
                            {"type": "output_text", "text": "two", "annotations": []}]},
               {"type": "message", "id": "m2", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "three", "annotations": []}]},
               {"type": "function_call_output", "call_id": "c0", "output": "x"},
               {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
               {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
               {"type": "reasoning", "id": "rs_3", "summary": []}],
     "reasoning": {"effort": "none"}, "chat_template_kwargs": {"enable_thinking": True}},
    # assistant dicts (no type): parts, then one merged with a call before it
    {"input": [{"type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "u1"},
                            {"type": "input_text", "text": "u2"}]},
               {"role": "assistant", "content": [{"type": "input_text", "text": "a1"},
                                                 {"type": "input_text", "text": "a2"}]},
               {"role": "user", "content": "again"},
               {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
               {"role": "assistant", "content": "after the call"},
               {"type": "function_call_output", "call_id": "c1",
                "output": [{"type": "input_text", "text": "part out"}]}],
     "tools": [{"type": "web_search"}, {"type": "function", "name": "f"}]},
    # custom and namespace tools, and their calls
    {"input": [{"role": "user", "content": "patch it"},
               {"type": "custom_tool_call", "call_id": "c1", "name": "apply",
                "input": "diff --git é"},
               {"type": "custom_tool_call_output", "call_id": "c1", "output": "ok"},
               {"type": "function_call", "call_id": "c2", "name": "ls", "namespace": "fs",
                "arguments": '{"p": "/"}'}],
     "tools": [{"type": "custom", "name": "apply", "description": "apply a patch"},
               {"type": "namespace", "name": "fs", "description": "files",
                "tools": [{"type": "function", "name": "ls", "description": "list",
                           "parameters": {"type": "object"}}]}],
     "tool_choice": "auto", "reasoning": {"effort": "high"}},
    # an unfinished answer: continued, no generation prompt
    {"input": [{"role": "user", "content": "tell a story"},
               {"type": "message", "role": "assistant", "status": "in_progress",
                "content": [{"type": "output_text", "text": "Once upon"}]}]},
    {"input": [{"role": "user", "content": "q"},
               {"type": "message", "id": "m", "role": "assistant", "status": "incomplete",
                "content": [{"type": "output_text", "text": "cut", "annotations": []}]}],
     "instructions": ""},
]


def _vllm_responses(body: dict[str, Any], fmt: str) -> tuple[Any, Any, dict[str, Any]]:
    """What vLLM 0.33 renders a Responses request into: the conversation its chat parser
    hands the template (content format ``fmt``), the tools and the template variables. Its
    chat parser needs its model config for two flags; a stand-in gives them (the one part
    of this that is not vLLM's own)."""
    import copy
    import types

    from engine_helpers import import_or_skip

    proto = import_or_skip("vllm.entrypoints.openai.responses.protocol", "vllm")
    utils = import_or_skip("vllm.entrypoints.openai.responses.utils", "vllm")
    cm = import_or_skip("vllm.renderers.chat_utils.chat_message", "vllm")
    req = proto.ResponsesRequest.model_validate(copy.deepcopy({"model": "m", **body}))
    msgs = utils.construct_input_messages(request_instructions=req.instructions,
                                          request_input=req.input)
    cfg = types.SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None,
                                is_multimodal_model=False)
    conv, _, _ = cm.parse_chat_messages(msgs, cfg, fmt)
    return (conv, utils.construct_tool_dicts(req.tools, req.tool_choice),
            req.build_chat_params(None, fmt).chat_template_kwargs)


def _ours(body: dict[str, Any], fmt: str) -> tuple[Any, Any, dict[str, Any]]:
    conv = chat_request(body.get("instructions"), body["input"], body.get("tools"),
                        body.get("reasoning"))
    assert conv is not None, body
    return (as_engine_messages(conv.messages, fmt), as_engine_tools(conv.tools),
            engine_template_kwargs(body.get("chat_template_kwargs"),
                                   add_generation_prompt=not conv.continue_final_message,
                                   continue_final_message=conv.continue_final_message,
                                   reasoning_effort=conv.reasoning_effort))


def test_chat_request_equals_vllms_own_construction() -> None:
    """Every request of the corpus, in both content formats: the conversation, the tools
    and the template variables equal what vLLM 0.33's own functions make of it
    (ResponsesRequest, construct_input_messages, parse_chat_messages,
    construct_tool_dicts, build_chat_params; the engines tier)."""
    for body in _RESPONSES:
        for fmt in ("string", "openai"):
            assert _ours(body, fmt) == _vllm_responses(body, fmt), (fmt, body)


def test_responses_tokenize_as_vllm_renders_them(tmp_path: Any) -> None:
    """The ids the proxy routes a Responses request with (body decoded as the proxy
    decodes it) equal transformers' apply_chat_template on Qwen3's template and tokenizer
    given what vLLM makes of the request: a router that rendered each item as its own turn
    (as kvwire did before) got other ids from the first merged assistant turn on."""
    import asyncio
    import lzma
    import shutil

    from engine_helpers import import_or_skip
    from test_proxy import ROOT

    from kvwire.consume.engine_spec import EngineSpec
    from kvwire.proxy.body import pass_dec as _pass_dec
    from kvwire.proxy.proxy import Proxy
    from kvwire.routing.core import RouterCore

    transformers = import_or_skip("transformers", "transformers")
    src = ROOT / "tests/data/tokenize/qwen3"
    shutil.copy(src / "tokenizer_config.json", tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(lzma.decompress(
        (src / "tokenizer.json.xz").read_bytes()))
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    tok = load_tokenizer(tmp_path)
    proxy = Proxy(RouterCore([EngineSpec("e0", "tcp://127.0.0.1:9",
                                         url="http://127.0.0.1:9")]), tok)
    for body in _RESPONSES:
        conv, tools, kw = _vllm_responses(body, tok.content_format())
        want = ref.apply_chat_template(conv, tools=tools, tokenize=True, **kw)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        got = asyncio.run(proxy.tokens.response(_pass_dec.decode(json.dumps(
            {"model": "m", **body}).encode())))
        assert list(got) == want, body
    assert proxy.counts["responses_by_load"] == 0


def test_a_new_response_request_follows_the_cache_of_its_chat(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """A /v1/responses that starts a conversation is tokenized as the chat it renders to, so
    it goes to the engine that holds that chat's prefix (kvwire engines do not serve the
    Responses API: they answer 404, with the proxy's x-kvwire-engine telling where it went).
    One holding items the proxy does not map goes by load, counted."""
    s = make_stack(3)
    tok = load_tokenizer(None)
    system, user = "You answer in verse. " + "rules of rhyme " * 150, "a question"
    chat = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "system", "content": system}, {"role": "user", "content": user}]}
    ids = tok.encode_chat(chat["messages"])
    conv = chat_request(system, [{"role": "user",
                                  "content": [{"type": "input_text", "text": user}]}])
    assert conv is not None and tok.encode_engine_chat(conv.messages) == ids
    with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        home = r.headers["x-kvwire-engine"]

        def held() -> bool:
            """The index credits ``home`` with the most of the chat, and with some: every
            engine at 0 is a tie, not a holder (before an engine's first events the router
            knows no block size to predict with, and on a loaded box they come late)."""
            with s.core.lock:
                m = s.core.index.match(ids)
            best = max(m, key=lambda k: m[k].credit, default=None)
            return best is not None and m[best].credit > 0 and best.split("/")[0] == home

        wait_for(held, "the chat's prefix in the index")
        for _ in range(6):  # the load of the answered chat is released: any engine is idle
            r = c.post("/v1/responses", json={"model": "m", "instructions": system,
                                               "input": user})
            assert r.headers["x-kvwire-engine"] == home, r.text
        by_load = s.proxy.counts["responses_by_load"]
        r = c.post("/v1/responses", json={"model": "m", "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
        assert "x-kvwire-engine" in r.headers
        assert s.proxy.counts["responses_by_load"] == by_load + 1
    wait_for(lambda: s.loads() == {}, "every reservation released")


def test_with_no_id_table_every_request_is_looked_up(
        make_stack: Callable[..., Stack]) -> None:  # noqa: F811 (the fixture)
    """``--response-ids 0``: nothing remembered, yet a follow-up still reaches the holder
    (asked of each engine in turn)."""
    a, b = _ResponseStore(), _ResponseStore()
    try:
        s = make_stack(2, policy=RoundRobinPolicy(), urls=[a.url, b.url], response_ids=0)
        with httpx.Client(base_url=s.url, timeout=TIMEOUT) as c:
            rid, eng = _create(c)
            for _ in range(3):
                rid, e = _create(c, prev=rid)
                assert e == eng
        assert len(s.proxy.owners) == 0 and s.proxy.counts["responses_looked_up"] == 3
    finally:
        a.close()
        b.close()
