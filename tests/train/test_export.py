"""Exported model folders read the same in transformers as in hypic, and the bundled one's
tokenizer_config.json changes nothing hypic reads."""

import json
import shutil

from transformers import AutoTokenizer

from hypic import LLM, SamplingParams
from hypic.llm import bundled_model_path
from hypic.models.fingerprint import weight_fingerprint
from hypic.models.loader import load_model
from hypic.server.chat import ChatTemplate
from hypic.train.export import export

TEXTS = ["Question: Who founded the partner of the Quicksilver Works?\nAnswer:",
         "Profile of Tal. Tal plays the harp in the evening after work.", " leading space, then<|end|> and more"]


def _same_tokens(folder) -> None:
    """AutoTokenizer on ``folder`` gives hypic's token ids and eos."""
    hypic = load_model(folder, device="cpu")
    hf = AutoTokenizer.from_pretrained(str(folder))
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False) == hypic.tokenizer.encode(text, add_special_tokens=False).ids
    assert hf.eos_token_id == hypic.config["eos_token_id"] and hf.pad_token_id == hypic.config["pad_token_id"]


def test_an_exported_checkpoint_tokenizes_in_transformers_as_in_hypic(tiny_trained_model, tmp_path) -> None:
    ckpt = shutil.copytree(tiny_trained_model, tmp_path / "ckpt")
    _same_tokens(ckpt)  # a training checkpoint's own folder
    (ckpt / "tokenizer_config.json").unlink()  # as a device run's checkpoint: none
    export(ckpt, tmp_path / "exported")
    hf_config = json.loads((tmp_path / "exported" / "tokenizer_config.json").read_text())
    assert hf_config == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|end|>",
                         "pad_token": "<|endoftext|>"}
    _same_tokens(tmp_path / "exported")


def test_the_bundled_model_tokenizes_in_transformers_as_in_hypic() -> None:
    _same_tokens(bundled_model_path())


def test_the_bundled_tokenizer_config_changes_nothing_hypic_reads(tmp_path) -> None:
    """The same folder with and without the file: the engine's fingerprint (the saved cache's stamp
    with the weights'), the eos ids, the chat template and its render, token ids and answers."""
    folder = shutil.copytree(bundled_model_path(), tmp_path / "model")
    hf_config = (folder / "tokenizer_config.json").read_text()
    (folder / "tokenizer_config.json").unlink()
    doc = "Profile of Tal. Tal plays the harp in the evening after work."
    prompt = ["A reader.", doc, "Question: What does Tal play?\nAnswer:"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": doc}]

    def seen(llm: LLM) -> dict:
        template = ChatTemplate.from_model(llm.loaded.tokenizer_config, llm.loaded.path)
        eos = sorted(llm.engine.eos)
        return {"fingerprint": llm.engine.fingerprint, "weights": weight_fingerprint(llm.engine.model), "eos": eos,
                "template": template.source, "bos": template.bos_token, "render": template.render(messages, True),
                # /tokenizer_info's eos: the template's, else the config's first eos id
                "eos_text": template.eos_token or llm.tokenizer.id_to_token(eos[0]),
                "ids": llm.tokenize(prompt), "answer": llm.generate(prompt, SamplingParams(max_tokens=6))[0].token_ids,
                "chat": llm.chat(messages, SamplingParams(max_tokens=6))[0].token_ids}

    without = LLM(str(folder), device="cpu")
    before = seen(without)
    saved = without.save_cache(tmp_path / "cache")
    without.close()
    (folder / "tokenizer_config.json").write_text(hf_config)
    with_file = LLM(str(folder), device="cpu")
    assert seen(with_file) == before
    assert saved > 0 and with_file.load_cache(tmp_path / "cache") == saved  # the saved cache's stamps match
    with_file.close()
