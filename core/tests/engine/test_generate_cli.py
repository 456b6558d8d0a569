"""``vllm-port generate``: text and token-id prompts, ``--json``, exit statuses, the bundled-model default."""

from __future__ import annotations

import json

import pytest

import vllm_port.data
from vllm_port.cli import main


def run(capsys, *argv):
    code = main(["generate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_output_has_outputs_platform_and_providers(capsys, llama_model):
    code, out, err = run(
        capsys,
        *("--model", str(llama_model), "--device", "cpu", "--json", "--temperature", "0", "--ignore-eos"),
        *("--max-tokens", "5", "The sea", "--prompt-token-ids", "5,6,7"),
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["platform"] == "cpu"
    assert report["provider_per_op"]["sample"] and "linear" in report["provider_per_op"]
    assert [len(o["token_ids"]) for o in report["outputs"]] == [5, 5]
    assert all(o["finish_reason"] == "length" and isinstance(o["text"], str) for o in report["outputs"])
    assert "loaded" in err and "generated 10 tokens for 2 request(s)" in err


def test_one_text_prompt_streams_its_completion(capsys, llama_model):
    code, out, _ = run(capsys, "--model", str(llama_model), "--device", "cpu", "--max-tokens", "8", "Once upon")
    assert code == 0 and out.startswith("Once upon")


def test_a_refused_request_is_exit_status_1(capsys, llama_model):
    code, out, err = run(capsys, "--model", str(llama_model), "--device", "cpu", "--json", "--prompt-token-ids", "9999")
    assert code == 1
    assert json.loads(out)["outputs"][0]["finish_reason"] == "error"
    assert "9999 at 0 outside the model's vocabulary" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--top-p", "0"], "top_p is 0.0"),
        (["--temperature", "-1"], "temperature is -1.0"),
        (["--model", "/nonexistent/model"], "no config.json"),
        (["--device", "nosuchchip"], "names no installed platform"),
    ],
)
def test_bad_options_are_exit_status_2(capsys, llama_model, argv, message):
    code, _, err = run(capsys, "--model", str(llama_model), "--device", "cpu", *argv)
    assert code == 2 and message in err


def test_without_a_model_it_loads_the_bundled_one(capsys, monkeypatch, tmp_path, llama_model):
    monkeypatch.setattr(vllm_port.data, "BUNDLED_MODEL_DIR", tmp_path / "absent")
    code, _, err = run(capsys, "--device", "cpu")
    assert code == 2 and "lacks config.json" in err and "--model DIR" in err
    monkeypatch.setattr(vllm_port.data, "BUNDLED_MODEL_DIR", llama_model)
    code, out, err = run(capsys, "--device", "cpu", "--max-tokens", "3", "--json")
    assert code == 0 and len(json.loads(out)["outputs"][0]["token_ids"]) <= 3
