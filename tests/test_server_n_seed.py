"""``n`` with ``seed``: choice i samples with ``seed + i``, so the n choices differ and each one
equals a single request with that seed (the tiny model behind a real server on 127.0.0.1)."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server[0].url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_n_with_seed_gives_child_i_seed_plus_i(client, route):
    kw = dict(model="tiny", max_tokens=12, temperature=0.9, extra_body={"ignore_eos": True})

    def ask(n: int, seed: int) -> list[str]:
        if route == "completions":
            r = client.completions.create(prompt="Once upon", n=n, seed=seed, **kw)
            return [c.text for c in r.choices]
        r = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], n=n,
                                           seed=seed, **kw)
        return [c.message.content for c in r.choices]

    three = ask(3, 11)
    assert len(set(three)) == 3                                  # distinct choices
    assert three == [ask(1, 11 + i)[0] for i in range(3)]        # child i = seed + i
    assert ask(3, 11) == three                                   # and reproducible
