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
from blockspec import tiny_model
from blockspec.args import EngineArgs
from blockspec.cli import build_parser, main
from blockspec.flags import HelpFormatter
from blockspec.demo_family import EXAMPLE_QUESTION, FAMILY_DIR
from blockspec.eval.answers import gold_answer
from blockspec.eval.gsm8k import DEFAULT_DATA

QUANT_FIX = Path(__file__).parent / "fixtures" / "modelopt" / "dense"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tiny_model.write_tiny_model(tmp_path_factory.mktemp("cli") / "demo"))


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
    fmt = HelpFormatter("blockspec")
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
    assert tuple(by_flag["--speculative-algorithm"].choices) == (*args_mod.SPEC_ALGORITHMS, "NONE")
    assert by_flag["--speculative-algorithm"].type("dspark") == "DSPARK"
    assert by_flag["--speculative-algorithm"].type("none") == "NONE"
    # NONE (or "off") is speculation off, draft path or not
    assert EngineArgs.from_kwargs(model_path="m", speculative_algorithm="NONE").speculative_algorithm is None
    assert EngineArgs.from_kwargs(model_path="m", speculative_algorithm="off",
                                  speculative_draft_model_path="d").speculative_algorithm is None
    with pytest.raises(args_mod.ArgsError, match="DFLASH, DSPARK or NONE"):
        EngineArgs.from_kwargs(model_path="m", speculative_algorithm="eagle")


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


def _interruptible() -> None:
    """SIGINT back to its default in a child: a suite started in the background (``nohup ...
    &``) hands its processes an ignored SIGINT, and Python then never raises
    KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("when", ["loading", "generating"])
def test_ctrl_c_exits_130_with_one_line_and_no_partial_files(tmp_path, when):
    """Ctrl-C while the demo family loads (0.5 s after the notice) and mid-generation (once the
    --verbose progress bar shows, 3 s into a 900-token run): one line, exit 130, nothing
    written anywhere."""
    home = tmp_path / "home"
    home.mkdir()
    env = {**os.environ, "BLOCKSPEC_CACHE": str(tmp_path / "cache"), "HOME": str(home)}
    p = subprocess.Popen([sys.executable, "-m", "blockspec", "generate", "--input-ids", "1,2,3",
                          "--max-new-tokens", "900", "--ignore-eos", "--device", "cpu",
                          *(["--verbose"] if when == "generating" else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=_interruptible)
    try:
        notice = p.stderr.readline()               # printed once torch is imported
        assert f"demo family's target {FAMILY_DIR / 'target'} (DFLASH on" in notice, notice
        if when == "loading":
            time.sleep(0.5)
        else:
            assert p.stderr.read(1), "no progress bar"   # the bar's first character
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    lines = [ln for ln in err.replace("\r", "\n").splitlines() if ln.strip()]
    assert lines[-1] == "blockspec generate: interrupted", err
    if when == "loading":
        assert lines == ["blockspec generate: interrupted"], err
    else:
        assert all("tok" in ln for ln in lines[:-1]), err          # the progress bar only
    assert out == ""
    assert not (tmp_path / "cache").exists() and not list(home.iterdir())   # nothing written


def test_an_interrupt_torch_turns_into_an_error_still_exits_130(monkeypatch, capsys):
    """A KeyboardInterrupt raised inside a torch call can come out as another exception (``could
    not determine the shape of object type 'torch.storage.UntypedStorage'``, seen while the
    family loaded): after a SIGINT that is an interrupt, not an error."""
    import blockspec.cli as cli

    def converted(ns):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            raise RuntimeError("could not determine the shape of object type 'X'") from None
        return 0

    def plain(ns):
        raise RuntimeError("a real error")

    inherited = signal.getsignal(signal.SIGINT)
    if inherited == signal.SIG_IGN:             # a background run (see _interruptible)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        before = signal.getsignal(signal.SIGINT)
        argv = ("quantize", "--model-path", "a", "--output", "b", "--quant-algo", "fp8")
        monkeypatch.setitem(cli.COMMANDS, "quantize", converted)
        assert _run(capsys, *argv)[::2] == (130, "blockspec quantize: interrupted\n")
        monkeypatch.setitem(cli.COMMANDS, "quantize", plain)
        assert _run(capsys, *argv)[::2] == (2, "blockspec quantize: error: a real error\n")
        assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_generate_without_model_path_answers_with_the_demo_family(capsys):
    """The README's first command: the demo family answers a shipped test question, speculation
    on, and the accept length is printed; DSPARK picks the DSpark draft, NONE turns it off, and
    the answer is the same every time (greedy, lossless)."""
    row = json.loads(DEFAULT_DATA.read_text().splitlines()[0])
    assert row["question"] == EXAMPLE_QUESTION and gold_answer(row["answer"]) == "147"
    runs = {}
    for algo in (None, "DSPARK", "NONE"):
        rc, out, err = _run(capsys, "generate", EXAMPLE_QUESTION, "--device", "cpu",
                            *(("--speculative-algorithm", algo) if algo else ()))
        assert rc == 0, err
        assert out.rstrip().endswith("#### 147"), out
        lines = err.splitlines()
        assert lines[0].startswith(f"blockspec: no --model-path: using the demo family's target "
                                   f"{FAMILY_DIR / 'target'} ("), err
        runs[algo] = out, lines
    (out, lines), (sout, slines), (nout, nlines) = runs[None], runs["DSPARK"], runs["NONE"]
    assert out == sout == nout
    assert f"(DFLASH on, draft {FAMILY_DIR / 'dflash'})" in lines[0]
    assert f"(DSPARK on, draft {FAMILY_DIR / 'dspark'})" in slines[0]
    assert "(speculation off)" in nlines[0] and len(nlines) == 1      # no accept-length line
    for algo, ls in (("DFLASH", lines), ("DSPARK", slines)):
        assert len(ls) == 2 and ls[1].startswith(f"blockspec: {algo} accept length "), ls
        assert ls[1].endswith("verify width 8)"), ls
        assert float(ls[1].split("accept length ")[1].split()[0]) > 2.0, ls   # drafts accepted
    meta = _json(capsys, "generate", EXAMPLE_QUESTION, "--device", "cpu")["meta_info"]
    assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 2.0


# ---- quantize ---------------------------------------------------------------------------------
def test_cli_quantize_refuses_a_non_empty_output_in_one_line(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("mine")
    rc, _, err = _run(capsys, "quantize", "--model-path", str(QUANT_FIX), "--output", str(tmp_path),
                      "--quant-algo", "fp8")
    assert rc == 2 and len(err.splitlines()) == 1
    assert "blockspec quantize: error:" in err and "not empty" in err and "--overwrite" in err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]
