"""A tokenizer that puts a BOS first, as Llama, Mistral and Gemma tokenizers do, built offline:
characters as tokens, a `<s> $A` post-processor, and a chat template that writes `<s>` itself."""

from tokenizers import Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
ALPHABET = "0123456789+-*=?.,: abcdefghijklmnopqrstuvwxyz\n"


def bos_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate([PAD, BOS, EOS, UNK, *ALPHABET])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))  # no merges = characters
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
