"""The command line a newcomer meets: help for every flag without importing torch, --stop,
--chat, batches of prompts, timing in meta_info, Ctrl-C, one-line errors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest

from blockspec import args as args_mod
from blockspec import demo
from blockspec.args import EngineArgs
from blockspec.cli import _HelpFormatter, build_parser, main

QUANT_FIX = Path(__file__).parent / "fixtures" / "modelopt" / "dense"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(demo.write_demo_model(tmp_path_factory.mktemp("cli") / "demo"))


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _json(capsys, *argv: str):
    rc, out, err = _run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


# ---- help -------------------------------------------------------------------------------------
def _subparsers(parser):
    action = next(a for a in parser._actions if a.choices and a.dest == "command")
    return action.choices


def test_every_flag_has_help_with_default_and_choices():
    parser = build_parser()
    fmt = _HelpFormatter("blockspec")
    checked = 0
    for name, sub in _subparsers(parser).items():
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = fmt._get_help_string(action)
            assert action.help, f"{name} {action.option_strings[0]} has no help"
            assert "default" in text or action.required, (name, action.option_strings, text)
            if action.choices:
                assert all(str(c) in text for c in action.choices), (name, action.option_strings, text)
            checked += 1
    assert checked > 40


def test_engine_args_carry_their_help_and_registry_choices(monkeypatch):
    for f in fields(EngineArgs):
        if f.name != "extra":
            assert f.metadata.get("help"), f"EngineArgs.{f.name} has no help (use arg(default, help))"
    extra = args_mod.BackendInfo("test_backend", ("cpu",))
    monkeypatch.setitem(args_mod.BACKENDS, "test_backend", extra)
    gen = _subparsers(build_parser())["generate"]
    by_flag = {a.option_strings[0]: a for a in gen._actions if a.option_strings}
    assert "test_backend" in by_flag["--attention-backend"].choices
    assert tuple(by_flag["--speculative-algorithm"].choices) == args_mod.SPEC_ALGORITHMS
    assert by_flag["--speculative-algorithm"].type("dspark") == "DSPARK"


def test_bench_flag_choices_match_the_bench():
    from blockspec.bench import bench_args, presets

    assert set(bench_args.PRESET_NAMES) == set(presets.PRESETS)


def test_help_version_and_arg_errors_do_not_import_torch():
    runner = (
        "import contextlib, io, json, sys\n"
        "from blockspec.cli import main\n"
        "codes = {}\n"
        "for argv in (['--help'], ['generate', '--help'], ['bench', '--help'], ['quantize', '--help'],\n"
        "             ['--version'], ['generate', '--dtype', 'int3'], ['generate', 'hi', '--top-k', 'x']):\n"
        "    buf = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):\n"
        "        try:\n"
        "            main(argv)\n"
        "        except SystemExit as e:\n"
        "            codes[' '.join(argv)] = (e.code, buf.getvalue())\n"
        "print(json.dumps({'torch': 'torch' in sys.modules, 'codes': codes}))\n")
    r = subprocess.run([sys.executable, "-c", runner], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["torch"] is False
    codes = got["codes"]
    assert codes["--help"][0] == 0 and "quantize" in codes["--help"][1]
    assert codes["generate --help"][0] == 0 and "--speculative-algorithm" in codes["generate --help"][1]
    assert codes["--version"][0] == 0 and codes["--version"][1].startswith("blockspec ")
    for bad in ("generate --dtype int3", "generate hi --top-k x"):
        code, text = codes[bad]
        assert code == 2 and len(text.strip().splitlines()) == 1 and "error" in text, (bad, text)
    m = subprocess.run([sys.executable, "-m", "blockspec", "--version"], capture_output=True,
                       text=True, timeout=60)
    assert m.returncode == 0 and m.stdout.startswith("blockspec ")


# ---- generate ---------------------------------------------------------------------------------
def test_stop_strings_and_stop_token_ids_cut_output(model, capsys):
    base = ("generate", "--model-path", model, "Hello", "--max-new-tokens", "40", "--ignore-eos",
            "--device", "cpu")
    full = _json(capsys, *base)
    text, ids = full["text"], full["output_ids"]
    at = next((i for i, c in enumerate(text) if i >= 2 and c.isascii() and c.isalnum()), None)
    assert at is not None, f"no ASCII letter or digit to stop on in {text!r}"
    stop = text[at]
    cut = _json(capsys, *base, "--stop", "never-seen", "--stop", stop)
    assert cut["text"] == text[:text.index(stop)]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}

    tok = ids[5]
    cut = _json(capsys, *base, "--stop-token-ids", f"{tok},{tok}")
    assert cut["output_ids"] == ids[:ids.index(tok) + 1]
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": tok}


def test_chat_applies_the_tokenizer_template(model, capsys):
    from blockspec.tokenizer import Tokenizer

    tok = Tokenizer(model)
    templated = tok.apply_chat_template([{"role": "user", "content": "hi there"}])
    assert templated.endswith("assistant: ") and "hi there" in templated
    args = ("generate", "--model-path", model, "--max-new-tokens", "6", "--ignore-eos", "--device", "cpu")
    chat = _json(capsys, *args, "--chat", "hi there")
    want = _json(capsys, *args, "--input-ids", ",".join(map(str, tok.encode(templated))))
    assert chat["meta_info"]["prompt_tokens"] == len(tok.encode(templated)) > len(tok.encode("hi there"))
    assert chat["output_ids"] == want["output_ids"]


def test_several_prompts_run_as_one_batch(model, capsys, tmp_path):
    f = tmp_path / "prompts.txt"
    f.write_text("second prompt\n\nthird\n")
    args = ("generate", "--model-path", model, "--max-new-tokens", "4", "--ignore-eos", "--device", "cpu")
    outs = _json(capsys, *args, "--prompt", "first", "--prompt-file", str(f))
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [5, 13, 5]
    rc, out, err = _run(capsys, *args, "--prompt", "a", "--prompt", "b", "--verbose")
    assert rc == 0 and out.startswith("==> prompt 1/2 <==\n") and "==> prompt 2/2 <==" in out
    metas = [json.loads(ln.split(": ", 1)[1]) for ln in err.splitlines() if ln.startswith("meta_info[")]
    assert len(metas) == 2 and all(m["completion_tokens"] == 4 and m["e2e_latency"] > 0 for m in metas)


def test_ctrl_c_exits_130_with_one_line_and_no_partial_files(tmp_path):
    env = {**os.environ, "BLOCKSPEC_CACHE": str(tmp_path / "cache")}
    p = subprocess.Popen([sys.executable, "-m", "blockspec", "generate", "--input-ids", "1,2,3",
                          "--max-new-tokens", "30000", "--ignore-eos", "--device", "cpu"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        notice = p.stderr.readline()               # printed once torch is imported
        assert "random-weight demo model at" in notice, notice
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert [ln for ln in err.splitlines() if ln.strip()] == ["blockspec generate: interrupted"]
    assert out == ""
    assert not list((tmp_path / "cache").glob("*.tmp*"))


# ---- quantize ---------------------------------------------------------------------------------
def test_cli_quantize_refuses_a_non_empty_output_in_one_line(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    rc, _, err = _run(capsys, "quantize", "--model-path", str(QUANT_FIX), "--output", str(tmp_path),
                      "--quant-algo", "fp8")
    assert rc == 2 and len(err.splitlines()) == 1
    assert "blockspec quantize: error:" in err and "not empty" in err and "--overwrite" in err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
