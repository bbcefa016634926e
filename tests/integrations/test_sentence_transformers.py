"""An embedding model trained through sentence-transformers, as people fine-tune one: a tiny
random Gemma-3 text model with bidirectional attention (the set-up of embedding models built
on Gemma-3), mean pooling, a padded batch of sentence pairs and the in-batch contrastive loss
(MultipleNegativesRankingLoss), its transformer compiled with ``backend="compile_pass"``.
One step's loss and every gradient equal eager's and an fp64 reference's, with both attention
layers on the op. The tokenizer is built here from a word list: nothing is downloaded."""

import copy

import sentence_transformers
import torch
from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import Gemma3TextConfig, Gemma3TextModel, PreTrainedTokenizerFast

from tests.helpers.models import Capture, assert_close_scaled

WORDS = "the a cat dog sat on mat ran fast slow red blue green big small and".split()
ANCHORS = ["the cat sat on the mat and the dog ran fast", "a red dog", "big green cat ran"]
POSITIVES = ["the dog sat on a mat", "a blue cat sat on the small red mat and ran", "slow dog"]


def _embedding_model(directory) -> sentence_transformers.SentenceTransformer:
    vocab = {"<pad>": 0, "<unk>": 1, **{word: index + 2 for index, word in enumerate(WORDS)}}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>").save_pretrained(directory)
    config = Gemma3TextConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True,
        attn_implementation="sdpa",
        max_position_embeddings=128,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    Gemma3TextModel(config).save_pretrained(directory)
    return sentence_transformers.SentenceTransformer(
        modules=[Transformer(str(directory)), Pooling(config.hidden_size, "mean")], device="cpu"
    )


def _loss_and_grads(model, anchors, positives):
    model.zero_grad(set_to_none=True)
    loss = MultipleNegativesRankingLoss(model)([anchors, positives], None)
    loss.backward()
    grads = {name.replace("._orig_mod", ""): p.grad.detach().clone() for name, p in model.named_parameters()}
    return loss.detach(), grads


def test_a_contrastive_step_through_sentence_transformers_is_eagers_with_both_layers_on_the_op(tmp_path):
    model = _embedding_model(tmp_path)
    anchors, positives = model.preprocess(ANCHORS), model.preprocess(POSITIVES)
    assert not anchors["attention_mask"].all()  # a padded batch
    eager, reference = copy.deepcopy(model), copy.deepcopy(model).double()
    capture = Capture()
    torch._dynamo.reset()
    model[0].model = torch.compile(model[0].model, backend=capture)
    loss, grads = _loss_and_grads(model, anchors, positives)
    eager_loss, eager_grads = _loss_and_grads(eager, anchors, positives)
    reference_loss, reference_grads = _loss_and_grads(reference, anchors, positives)
    assert_close_scaled(loss, eager_loss, "loss vs eager")
    assert_close_scaled(loss, reference_loss, "loss vs fp64")
    assert grads.keys() == reference_grads.keys()
    for name in grads:
        assert_close_scaled(grads[name], eager_grads[name], name)
        assert_close_scaled(grads[name], reference_grads[name], name)
    verdicts = {d.layer_type: d.verdict for report in capture.reports for d in report}
    assert verdicts == {
        "sliding_attention": "rewritten: window (2, 2), key padding from attention_mask",
        "full_attention": "rewritten: window (-1, -1), key padding from attention_mask",
    }
