"""Trainer values -> valid samples (unit tests: no queue involved)."""

from __future__ import annotations

import numpy as np

from qreward_queue.integrations.coerce import as_text, make_sample, render_chat, to_json_safe
from qreward_queue.samples import sample_problem


def test_chat_messages_render_as_text():
    chat = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}]
    assert render_chat(chat) == "system: Be brief.\n\nuser: 2+2?"
    assert render_chat([{"role": "assistant", "content": "4"}]) == "4"
    assert render_chat(np.array(chat, dtype=object)) == render_chat(chat)
    assert render_chat("plain") is None


def test_references_of_any_type_become_text():
    assert as_text(["4", 4]) == '["4", 4]'
    assert as_text(np.int64(7)) == "7"
    assert as_text(np.str_("x")) == "x" and type(as_text(np.str_("x"))) is str
    assert as_text(None) is None


def test_non_json_extra_values_are_unwrapped_or_stringified_with_a_note():
    notes: list[str] = []
    value = to_json_safe({"num_turns": np.int64(2), "ok": np.bool_(True), "arr": np.arange(3),
                          "inf": float("inf"), "obj": object(), 3: (1, 2)}, notes)
    assert value["num_turns"] == 2 and type(value["num_turns"]) is int
    assert value["ok"] is True and value["arr"] == [0, 1, 2] and value["3"] == [1, 2]
    assert value["inf"] == "inf" and value["obj"].startswith("<object object")
    assert notes == ["extra.inf: non-finite float inf stringified", "extra.obj: object stringified"]


def test_make_sample_turns_what_verl_passes_into_a_valid_sample():
    sample = make_sample([{"role": "user", "content": "What is 2+2?"}], "4", [4],
                         np.str_("gsm8k"), {"split": "train", "num_turns": np.int64(1),
                                            "tool": object()}, id=np.int64(3))
    assert sample_problem(sample) is None
    assert sample["prompt"] == "What is 2+2?" and sample["reference"] == "[4]"
    assert sample["id"] == 3 and sample["data_source"] == "gsm8k"
    assert sample["extra"]["qrq_notes"] == ["extra.tool: object stringified"]
