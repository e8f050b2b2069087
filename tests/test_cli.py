"""Every bad input gets one line on stderr, a non-zero exit, no traceback and nothing partial on disk."""

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from quantkit.cli import app

runner = CliRunner()


def _quantize(*args):
    return runner.invoke(app, ["quantize", *args], catch_exceptions=False)


def _assert_one_line_error(result, code, *needles):
    assert result.exit_code == code, (result.exit_code, result.output)
    err = result.stderr.strip()
    assert "Traceback" not in result.output and "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


def _base(tmp_path, model):
    return ["--model", str(model), "--group-size", "32", "--num-samples", "2", "--seq-len", "16",
            "--output", str(tmp_path / "out")]


def test_missing_model(tmp_path):
    _assert_one_line_error(_quantize("--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o")), 2, "does not exist")


def test_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "m").mkdir()
    _assert_one_line_error(_quantize("--model", str(tmp_path / "m"), "--output", str(tmp_path / "o")), 2, "config.json")


def test_a_model_without_linear_layers_is_refused_naming_what_it_has(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    _assert_one_line_error(_quantize(*_base(tmp_path, tmp_path / "gpt2")), 2, "'gpt2' hold no nn.Linear", "Conv1D")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_corrupt_and_truncated_safetensors(tmp_path, tiny_models):
    import shutil

    bad = tmp_path / "corrupt"
    shutil.copytree(tiny_models["llama"], bad)
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    _assert_one_line_error(_quantize(*_base(tmp_path, bad)), 2, "corrupt safetensors")
    cut = tmp_path / "truncated"
    shutil.copytree(tiny_models["llama"], cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    _assert_one_line_error(_quantize(*_base(tmp_path, cut)), 2, "truncated safetensors")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_dataset_missing_empty_and_too_short(tmp_path, tiny_models):
    base = _base(tmp_path, tiny_models["llama"])
    _assert_one_line_error(_quantize(*base, "--dataset", str(tmp_path / "none.txt")), 2, "does not exist")
    (tmp_path / "empty.txt").write_text("")
    _assert_one_line_error(_quantize(*base, "--dataset", str(tmp_path / "empty.txt")), 2, "empty")
    (tmp_path / "short.txt").write_text("only a few words here")
    result = _quantize(*base, "--dataset", str(tmp_path / "short.txt"))
    _assert_one_line_error(result, 2, "too few", "tokens")
    assert not (tmp_path / "out").exists()


def test_unknown_method_and_scheme_list_valid_ones(tmp_path, tiny_models):
    base = _base(tmp_path, tiny_models["llama"])
    _assert_one_line_error(_quantize(*base, "--method", "magic"), 2, "unknown method 'magic'", "rtn")
    _assert_one_line_error(_quantize(*base, "--scheme", "W2A2"), 2, "unknown scheme", "W4A16")


def test_invalid_group_sizes(tmp_path, tiny_models):
    model = str(tiny_models["llama"])
    _assert_one_line_error(_quantize("--model", model, "--group-size", "0", "--output", str(tmp_path / "o")), 2,
                           "invalid group size")
    # 64 hidden / 128 intermediate: group 48 divides neither; the message names the layer and a size that fits
    _assert_one_line_error(_quantize("--model", model, "--group-size", "48", "--output", str(tmp_path / "o")), 2,
                           "model.layers.0.self_attn.q_proj", "--group-size")


def test_output_exists_needs_overwrite(tmp_path, tiny_models):
    base = _base(tmp_path, tiny_models["llama"])
    (tmp_path / "out").mkdir()
    _assert_one_line_error(_quantize(*base), 2, "already exists", "--overwrite")
    ok = _quantize(*base, "--overwrite", "--json")
    assert ok.exit_code == 0, ok.output
    summary = json.loads(ok.stdout)
    assert summary["scheme"] == "W4A16" and summary["quantized_linears"] == 14
    assert (tmp_path / "out" / "quantkit_manifest.json").is_file()


def test_disk_full_leaves_nothing(tmp_path, tiny_models, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    result = _quantize(*_base(tmp_path, tiny_models["llama"]))
    _assert_one_line_error(result, 1, "disk full")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_disk_full_midway_leaves_nothing(tmp_path, tiny_models, monkeypatch):
    real = os.pwrite
    calls = {"n": 0}

    def flaky(fd, data, offset):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(28, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", flaky)
    _assert_one_line_error(_quantize(*_base(tmp_path, tiny_models["llama"])), 1, "disk full")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_recipe_roundtrip_reproduces_run(tmp_path, tiny_models):
    first = tmp_path / "first"
    args = ["--model", str(tiny_models["llama"]), "--group-size", "32", "--num-samples", "2", "--seq-len", "16"]
    assert _quantize(*args, "--output", str(first)).exit_code == 0
    again = runner.invoke(app, ["quantize", "--recipe", str(first / "recipe.yaml"), "--output", str(tmp_path / "again")])
    assert again.exit_code == 0, again.output
    assert (first / "model.safetensors").read_bytes() == (tmp_path / "again" / "model.safetensors").read_bytes()


def test_inspect_verifies_hashes(tmp_path, tiny_models):
    out = tmp_path / "out"
    assert _quantize(*_base(tmp_path, tiny_models["llama"])).exit_code == 0
    good = runner.invoke(app, ["inspect", str(out), "--json"])
    assert good.exit_code == 0
    report = json.loads(good.stdout)
    assert report["hash_mismatches"] == [] and report["bits_per_weight"] > 4
    assert len(report["layers"]) == 2 and all(r["linears"] == 7 for r in report["layers"])
    config = out / "config.json"
    config.write_text(config.read_text().replace('"hidden_act"', '"hidden_act" ', 1))
    bad = runner.invoke(app, ["inspect", str(out)])
    assert bad.exit_code == 1 and "config.json" in bad.stderr
    missing = runner.invoke(app, ["inspect", str(tmp_path / "nothing")])
    assert missing.exit_code == 2


def test_help_lists_all_commands():
    result = runner.invoke(app, ["--help"])
    for command in ("quantize", "convert-mla", "eval", "inspect"):
        assert command in result.output


def _commands():
    import typer.main

    return sorted(typer.main.get_command(app).commands.items())


@pytest.mark.parametrize("name,command", _commands(), ids=[n for n, _ in _commands()])
def test_help_follows_command_line_conventions(name, command):
    """Flags show no value, positionals are UPPERCASE in usage and table, required ones are marked."""
    import re

    result = runner.invoke(app, [name, "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    assert result.exit_code == 0, result.output
    text = result.output
    usage = next(line for line in text.splitlines() if "Usage:" in line)
    flags = [p for p in command.params if getattr(p, "is_flag", False)]
    assert flags and "--help" in text
    for flag in [*flags, None]:
        opt = "--help" if flag is None else flag.opts[0]
        row = next(line for line in text.splitlines() if re.search(rf"\s{re.escape(opt)}\s", line))
        after = row.split(opt, 1)[1].split()
        assert not after or not after[0].startswith("<"), f"{opt} shows a value: {row.strip()}"
    for arg in [p for p in command.params if p.param_type_name == "argument"]:
        upper = arg.name.upper()
        assert re.search(rf"\b{upper}\b", usage) and "{" not in usage, usage
        row = next(line for line in text.splitlines() if upper in line and "Usage" not in line)
        assert arg.required and "*" in row and "[required]" in text


def test_command_list_has_one_line_summaries():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "200"}, terminal_width=200)
    rows = [line for line in result.output.splitlines() if line.startswith("│")]
    names = [n for n, _ in _commands()]
    listed = [line.split()[1] for line in rows if len(line.split()) > 1 and line.split()[1] in names]
    assert sorted(listed) == names
    # a command's summary continues on its own row only when the terminal is narrow: at 200 columns none does
    after = {line.split()[1]: i for i, line in enumerate(rows) if len(line.split()) > 1 and line.split()[1] in names}
    for name, i in after.items():
        nxt = rows[i + 1].split() if i + 1 < len(rows) else []
        assert not nxt or nxt[1] in names or nxt[0].startswith("╰"), f"{name}'s summary wraps: {rows[i + 1]}"


def test_inspect_table_keeps_every_value_whole_when_piped(tmp_path, tiny_models):
    out = tmp_path / ("checkpoint-with-a-name-long-enough-to-overflow-eighty-columns-" + "x" * 40)
    assert _quantize(*_base(tmp_path, tiny_models["llama"])[:-1], str(out)).exit_code == 0
    shown = runner.invoke(app, ["inspect", str(out)])
    report = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    assert shown.exit_code == 0 and "…" not in shown.stdout
    assert out.name in shown.stdout
    for layer in report["layers"]:
        assert f"{layer['rel_error']:.5f}" in shown.stdout


def test_convert_mla_reports_progress_lines_when_not_a_terminal(tmp_path, tiny_models, monkeypatch):
    import re

    import quantkit.convert.mla as mla

    monkeypatch.setattr(mla, "MIN_STEPS", 1500)  # no early stop: a run long enough for several progress intervals
    result = runner.invoke(app, ["convert-mla", "--model", str(tiny_models["llama"]), "--output", str(tmp_path / "m"),
                                 "--num-samples", "8", "--seq-len", "64", "--refine-steps", "1500"],
                           env={"QUANTKIT_NO_PROGRESS": None, "QUANTKIT_PROGRESS_INTERVAL": "0.5"})
    assert result.exit_code == 0, result.output
    stamps = [float(m) for m in re.findall(r"^\[\s*([0-9.]+) s\] convert-mla layers \d+/2", result.stderr, re.M)]
    assert stamps, result.stderr
    # the timer runs whether or not a layer finished: no gap between lines (or before the first) over 6 intervals (a loaded machine)
    assert len(stamps) >= 2 and all(b - a <= 3.0 for a, b in zip([0.0, *stamps], stamps)), stamps


def test_quantize_and_inspect_name_the_same_two_sizes(tmp_path, tiny_models):
    out = tmp_path / "out"
    made = json.loads(_quantize(*_base(tmp_path, tiny_models["llama"]), "--json").stdout)
    shown = json.loads(runner.invoke(app, ["inspect", str(out), "--json"]).stdout)
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    folder = sum(p.stat().st_size for p in out.iterdir() if p.is_file() and p.name != "quantkit_manifest.json")
    assert made["weights_bytes"] == shown["size_bytes"] == weights
    assert made["output_bytes"] == shown["folder_bytes"] == folder > weights
    text = _quantize(*_base(tmp_path, tiny_models["llama"]), "--overwrite").stdout
    assert f"weights {weights / 1e6:.1f} MB" in text and f"folder {folder / 1e6:.1f} MB" in text


@pytest.mark.parametrize("flag,value", [("--num-samples", "0"), ("--seq-len", "-5")])
def test_a_bad_count_names_the_option_that_is_wrong(tmp_path, tiny_models, flag, value):
    args = _base(tmp_path, tiny_models["llama"])
    args[args.index(flag) + 1] = value
    other = "--seq-len" if flag == "--num-samples" else "--num-samples"
    result = _quantize(*args)
    _assert_one_line_error(result, 2, flag, value)
    assert other not in result.stderr
    evaluated = runner.invoke(app, ["eval", str(tiny_models["llama"]), flag, value])
    _assert_one_line_error(evaluated, 2, flag, value)
    assert other not in evaluated.stderr


def test_options_without_effect_are_named_in_one_warning_each(tmp_path, tiny_models):
    model = ["--model", str(tiny_models["llama"]), "--seq-len", "16"]
    w8 = _quantize(*model, "--scheme", "W8A8", "--group-size", "64", "--num-samples", "2",
                   "--output", str(tmp_path / "w8"))
    assert w8.exit_code == 0, w8.output
    assert "warning: --group-size 64 has no effect with W8A8: its weight scales are per output channel" in w8.stderr
    fp8 = _quantize("--model", str(tiny_models["llama"]), "--method", "fp8", "--scheme", "FP8_DYNAMIC",
                    "--num-samples", "64", "--output", str(tmp_path / "fp8"))
    assert fp8.exit_code == 0, fp8.output
    assert "warning: --num-samples has no effect: fp8 with FP8_DYNAMIC is data-free" in fp8.stderr
    gptq = _quantize(*model, "--method", "gptq", "--group-size", "32", "--num-samples", "2", "--alpha", "0.5",
                     "--output", str(tmp_path / "gptq"))
    assert gptq.exit_code == 0, gptq.output
    assert gptq.stderr.count("warning:") == 1 and "--alpha has no effect: it is a smoothquant option" in gptq.stderr
    rtn = _quantize(*model, "--num-samples", "64", "--group-size", "32", "--output", str(tmp_path / "rtn"))
    assert rtn.exit_code == 0 and "warning: --num-samples 64 has no effect with rtn" in rtn.stderr
    used = _quantize(*model, "--method", "gptq", "--group-size", "32", "--num-samples", "2", "--actorder", "group",
                     "--output", str(tmp_path / "used"))
    assert used.exit_code == 0 and "warning" not in used.stderr


def test_manifest_has_the_phase_totals_the_readme_describes(tmp_path, tiny_models):
    out = tmp_path / "out"
    assert _quantize(*_base(tmp_path, tiny_models["llama"])).exit_code == 0
    manifest = json.loads((out / "quantkit_manifest.json").read_text())
    totals = manifest["phase_seconds"]
    assert "outside_layers" in totals and "forward" in totals
    for phase in set(totals) - {"outside_layers"}:
        summed = sum(r["phases"].get(phase, 0.0) for r in manifest["layers"])
        assert abs(totals[phase] - summed) < 0.01, phase
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "manifest sum them over the layers in `phase_seconds`" in readme


def _readme_synopses() -> list[tuple[str, set[str]]]:
    """(command, flags) of every `quantkit COMMAND ...` synopsis in README's bash blocks (continuation lines
    joined), so the README cannot name an option a command does not take."""
    import re

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        entries: list[str] = []
        for line in block.splitlines():
            code = line.split("  #")[0]
            if code.startswith("quantkit "):
                entries.append(code)
            elif entries and line.startswith(" ") and code.strip():
                entries[-1] += " " + code.strip()
            else:
                entries.append("")
        for e in entries:
            m = re.match(r"quantkit ([a-z-]+)", e)
            if m and m.group(1) not in ("A",):
                out.append((m.group(1), set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", e))))
    return out


def test_every_option_the_readme_shows_is_one_the_command_takes():
    commands = dict(_commands())
    synopses = _readme_synopses()
    assert {"quantize", "eval", "convert-mla", "check-serving", "moefy"} <= {c for c, _ in synopses}
    for name, flags in synopses:
        assert name in commands, f"README shows `quantkit {name}`, which is not a command"
        taken = {o for p in commands[name].params for o in (*p.opts, *getattr(p, "secondary_opts", []))}
        assert not flags - taken, f"README's `quantkit {name}` shows {sorted(flags - taken)}, which it does not take"


def _module_cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "quantkit", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "QUANTKIT_NO_PROGRESS": "1"})


def test_entry_point_exit_codes_and_streams(tmp_path):
    # The console entry skips the interpreter's teardown (cli._leave): the command's exit code and every byte it
    # printed must still arrive through a pipe.
    version = _module_cli("--version")
    assert version.returncode == 0 and version.stdout == "quantkit 0.1.0\n", version
    bad = _module_cli("quantize", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "does not exist" in bad.stderr
    assert not (tmp_path / "o").exists()


def test_entry_point_json_is_whole(tiny_models, tmp_path):
    out = tmp_path / "out"
    run = _module_cli("quantize", "--method", "rtn", *_base(tmp_path, tiny_models["llama"]), "--json")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout[run.stdout.index("{"):])  # the whole document: json.loads rejects a cut one
    assert summary["output"] == str(out) and (out / "config.json").exists()
    shown = _module_cli("inspect", str(out), "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout[shown.stdout.index("{"):])


def test_entry_point_runs_exit_handlers(tmp_path):
    # What libraries register with atexit (temporary folders, logging) still runs before the process leaves.
    import subprocess
    import sys

    mark = tmp_path / "ran"
    code = (f"import atexit, sys; atexit.register(lambda: open({str(mark)!r}, 'w').write('yes')); "
            "sys.argv = ['quantkit', 'inspect', '/nonexistent/checkpoint']; from quantkit.cli import main; main()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert mark.read_text() == "yes"
