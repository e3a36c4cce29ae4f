"""Model.tokenize / detokenize against tokenizers nobody here wrote: Hugging Face tokenizers'
ids for SmolLM2 (tests/data/smollm2_tokens.json, as the C++ tokenizer tests use) and
llama2.c's stories260K vocabulary."""

import json

from conftest import ROOT


def test_smollm2_matches_hugging_face_tokenizers(smollm2_model):
    cases = json.loads((ROOT / "tests" / "data" / "smollm2_tokens.json").read_text())["cases"]
    assert len(cases) >= 30
    for case in cases:
        ids = smollm2_model.tokenize(case["text"], add_bos=False)
        assert ids == case["ids"], case["text"]
        assert smollm2_model.detokenize(ids) == case["text"]


def test_stories260k_round_trip_and_bos(stories_model, stories_golden_sample):
    text = stories_golden_sample[:400]
    ids = stories_model.tokenize(text)
    assert ids[0] == stories_model.bos_id == 1  # llama2.c's <s>
    assert stories_model.tokenize(text, add_bos=False) == ids[1:]
    assert stories_model.detokenize(ids[1:]) == text
    # Bytes outside the 512-token vocabulary fall back to <0xXX> tokens (ids 3..258).
    ids = stories_model.tokenize("naïve ☃", add_bos=False)
    assert any(3 <= i <= 258 for i in ids)
    assert stories_model.detokenize(ids) == "naïve ☃"
