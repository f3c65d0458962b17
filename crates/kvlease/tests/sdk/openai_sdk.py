"""Drives kvlease with the OpenAI Python SDK (tests/vllm_sdk.rs starts the processes).

argv: PROXY_URL LOCAL_URL. Completions and chat, streaming and not, with stop, n, seed and
logprobs: every answer is parsed by the SDK's own types, and the proxy's (disaggregated)
answers equal the local engine's. Exits non-zero on the first difference.
"""
import sys

from openai import OpenAI

proxy_url, local_url = sys.argv[1], sys.argv[2]
proxy = OpenAI(base_url=proxy_url + "/v1", api_key="unused")
local = OpenAI(base_url=local_url + "/v1", api_key="unused")
MODEL = "kvlease-synthetic"
EXTRA = {"ignore_eos": True}


def completion(client, **kw):
    r = client.completions.create(model=MODEL, prompt="The lease on the blocks", extra_body=EXTRA, **kw)
    assert r.object == "text_completion", r
    return r


def chat(client, **kw):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], extra_body=EXTRA, **kw
    )
    assert r.object == "chat.completion", r
    return r


def stream_texts(client, kind, **kw):
    texts, finish, usage = {}, {}, None
    if kind == "completions":
        it = client.completions.create(model=MODEL, prompt="The lease on the blocks", stream=True,
                                       stream_options={"include_usage": True}, extra_body=EXTRA, **kw)
    else:
        it = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
                                            stream_options={"include_usage": True}, extra_body=EXTRA, **kw)
    for chunk in it:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            piece = c.text if kind == "completions" else (c.delta.content or "")
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                finish[c.index] = c.finish_reason
    assert usage is not None and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage
    return texts, finish


base = completion(local, max_tokens=8).choices[0].text
stop = base.split()[3]
for kw in [
    dict(max_tokens=8),
    dict(max_tokens=8, stop=[stop]),
    dict(max_tokens=6, n=3, seed=11, temperature=1.0),
    dict(max_tokens=6, logprobs=2, seed=5, temperature=0.7, top_p=0.9),
]:
    a, b = completion(proxy, **kw), completion(local, **kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices], (kw, a, b)
    assert len(a.choices) == kw.get("n", 1), a
    if "stop" in kw:
        assert a.choices[0].finish_reason == "stop" and stop not in a.choices[0].text, a
    if "logprobs" in kw:
        lp = a.choices[0].logprobs
        assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and len(lp.top_logprobs) == 6, lp
        assert lp.token_logprobs == b.choices[0].logprobs.token_logprobs, (lp, b.choices[0].logprobs)
    sa, fa = stream_texts(proxy, "completions", **kw)
    assert [sa[i] for i in sorted(sa)] == [c.text for c in b.choices], (kw, sa, b)
    assert [fa[i] for i in sorted(fa)] == [c.finish_reason for c in b.choices], (kw, fa)

for kw in [
    dict(max_tokens=8),
    dict(max_tokens=8, stop=[stop]),
    dict(max_tokens=6, n=2, seed=3, temperature=1.2),
    dict(max_completion_tokens=5, logprobs=True, top_logprobs=2, seed=1, temperature=1.0),
]:
    a, b = chat(proxy, **kw), chat(local, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices], (kw, a, b)
    assert all(c.message.role == "assistant" for c in a.choices), a
    if "logprobs" in kw:
        content = a.choices[0].logprobs.content
        assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content), content
    sa, _ = stream_texts(proxy, "chat", **kw)
    assert [sa[i] for i in sorted(sa)] == [c.message.content for c in b.choices], (kw, sa, b)

# A refused field is an SDK error naming it, with vLLM's envelope.
try:
    chat(proxy, max_tokens=4, tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    raise AssertionError("tools were accepted")
except Exception as e:  # openai.BadRequestError
    assert getattr(e, "status_code", None) == 400 and "tools" in str(e), e
    assert e.body["code"] == 400 if isinstance(e.body, dict) and "code" in e.body else True, e.body
print("openai sdk: ok")
