"""The built-in demo model: random weights, no download, so the app runs with nothing installed.

`demo` is a small Llama; `demo-135m` has SmolLM2-135M's exact shape, for benchmarks. Both use a
tokenizer built here: common English words (so a random model babbles words, not bytes), every
ASCII character, and byte fallback, so any text encodes and decodes losslessly.
"""

from __future__ import annotations

import random

import torch
from torch import nn

from engine.models.layers import RMSNorm

DEMO_MODELS = ("demo", "demo-135m")
SEED = 0

UNK, EOS, BOS, PAD, IM_START, IM_END = (
    "<unk>",
    "<|endoftext|>",
    "<|begin_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
)
SPECIAL_TOKENS = [UNK, EOS, BOS, PAD, IM_START, IM_END]  # ids 0..5
EOS_TOKENS = (IM_END, EOS)  # a chat turn ends with <|im_end|>; plain text with <|endoftext|>

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Roughly by frequency: the first ones also get capitalised and unspaced variants.
WORDS = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or
had by not word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make thing see
him two has look more day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live where after back
little only round man year came show every good me give our under name very through just form sentence
great think say help low line differ turn cause much mean before move right boy old too same tell does
set three want air well also play small end put home read hand port large spell add even land here
must big high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country found answer
school grow study still learn plant cover food sun four between state keep eye never last let thought
city tree cross farm hard start might story saw far sea draw left late run while press close night real
life few north open seem together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book carry took science eat
room friend began idea fish mountain stop once base hear horse cut sure watch color face wood main
enough plain girl usual young ready above ever red list though feel talk bird soon body dog family
direct pose leave song measure door product black short numeral class wind question happen complete
ship area half rock order fire south problem piece told knew pass since top whole king space heard
best hour better true during hundred five remember step early hold west ground interest reach fast verb
sing listen six table travel less morning ten simple several vowel toward war lay against pattern slow
center love person money serve appear road map rain rule govern pull cold notice voice unit power town
fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest correct able
pound done beauty drive stood contain front teach week final gave green quick develop ocean warm free
minute strong special mind behind clear tail produce fact street inch multiply nothing course stay
wheel full force blue object decide surface deep moon island foot system busy test record boat common
gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought
heat snow tire bring yes distant fill east paint language among grand ball yet wave drop heart present
heavy dance engine position arm wide sail material size vary settle speak weight general ice matter
circle pair include divide syllable felt perhaps pick sudden count square reason length represent art
subject region energy hunt probable bed brother egg ride cell believe fraction forest sit race window
store summer train sleep prove lone exercise wall catch mount wish sky board joy winter sat written
wild instrument kept glass grass cow job edge sign visit past soft fun bright gas weather month million
bear finish happy hope flower clothe strange gone jump baby eight village meet root buy raise solve
metal whether push seven paragraph third shall held hair describe cook floor either result burn hill
safe cat century consider type law bit coast copy phrase silent tall sand soil roll temperature finger
industry value fight lie beat excite natural view sense ear else quite broke case middle kill son lake
moment scale loud spring observe child straight consonant nation dictionary milk speed method organ pay
age section dress cloud surprise quiet stone tiny climb cool design poor lot experiment bottom key iron
single stick flat twenty skin smile crease hole trade melody trip office receive row mouth exact symbol
die least trouble shout except wrote seed tone join suggest clean break lady yard rise bad blow oil
blood touch grew cent mix team wire cost lost brown wear garden equal sent choose fell fit flow fair
bank collect save control decimal gentle woman captain practice separate difficult doctor please
protect noon whose locate ring character insect caught period indicate radio spoke atom human history
effect electric expect crop modern element hit student corner party supply bone rail imagine provide
agree thus capital chair danger fruit rich thick soldier process operate guess necessary sharp wing
create neighbor wash bat rather crowd corn compare poem string bell depend meat rub tube famous dollar
stream fear sight thin triangle planet hurry chief colony clock mine tie enter major fresh search send
yellow gun allow print dead spot desert suit current lift rose continue block chart hat sell success
company subtract event particular deal swim term opposite wife shoe shoulder spread arrange camp invent
cotton born determine quart nine truck noise level chance gather shop stretch throw shine property
column molecule select wrong gray repeat require broad prepare salt nose plural anger claim continent
oxygen sugar death pretty skill women season solution magnet silver thank branch match suffix
especially fig afraid huge sister steel discuss forward similar guide experience score apple bought
led pitch coat mass card band rope slip win dream evening condition feed tool total basic smell valley
nor double seat arrive master track parent shore division sheet substance favor connect post spend
chord fat glad original share station dad bread charge proper bar offer segment slave duck instant
market degree populate chick dear enemy reply drink occur support speech nature range steam motion
path liquid log meant quotient teeth shell neck computer model engine data memory cache block table
token sequence thread queue kernel server client request answer message window terminal screen garden
coffee morning quiet gentle bright silver golden river castle forest dragon wizard robot rocket
journey secret puzzle lantern harbor meadow thunder whisper shadow crystal ember velvet marble copper
""".split()

# Short pieces that help words outside the list encode in fewer tokens.
SUFFIXES = ["s", "ed", "ing", "ly", "er", "est", "'s", "n't", "'re", "'ll", "'ve", "'m", "'d", "tion"]
ASCII = [chr(c) for c in range(33, 127)]  # printable, space excluded (it becomes ▁)
SPACE = "\u2581"  # "▁": spaces are stored as this marker, as in SentencePiece


def _unique_words() -> list[str]:
    seen: set[str] = set()
    return [w for w in WORDS if not (w in seen or seen.add(w))]


def _vocab(vocab_size: int | None) -> list[tuple[str, float]]:
    """(piece, score) for the Unigram model: higher scores win, so whole words beat characters."""
    words = _unique_words()
    vocab: list[tuple[str, float]] = [(t, 0.0) for t in SPECIAL_TOKENS]
    # byte tokens are reached through byte fallback only: a literal "<0x41>" in text stays characters
    vocab += [(f"<0x{b:02X}>", -1000.0) for b in range(256)]
    vocab += [("\n", -5.0), (SPACE, -10.0)]
    vocab += [(c, -10.0) for c in ASCII] + [(SPACE + c, -10.0) for c in ASCII]
    vocab += [(s, -6.0) for s in SUFFIXES]
    for rank, word in enumerate(words):
        score = -1.0 - rank / len(words)  # common words a little more likely
        vocab.append((SPACE + word, score))
        if rank < 300:
            vocab.append((word, score - 0.5))
            vocab.append((SPACE + word.capitalize(), score - 0.5))
        if rank < 100:
            vocab.append((word.capitalize(), score - 1.0))
    seen: set[str] = set()
    vocab = [(p, s) for p, s in vocab if not (p in seen or seen.add(p))]
    if vocab_size is None:
        return vocab
    if vocab_size < len(vocab):
        raise ValueError(f"demo tokenizer needs vocab_size >= {len(vocab)}, got {vocab_size}")
    # fill up to the model's vocab with word pairs, scored so that encoding never picks them but a
    # random model sampling them still prints words
    rng = random.Random(SEED)
    while len(vocab) < vocab_size:
        piece = SPACE + rng.choice(words) + SPACE + rng.choice(words)
        if piece not in seen:
            seen.add(piece)
            vocab.append((piece, -100.0))
    return vocab


def base_vocab_size() -> int:
    return len(_vocab(None))


def demo_tokenizer(vocab_size: int | None = None):
    """The demo tokenizer as a transformers PreTrainedTokenizerFast (padded to `vocab_size` ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.Unigram(_vocab(vocab_size), unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def demo_config(name: str):
    """A LlamaConfig for "demo" (small) or "demo-135m" (SmolLM2-135M's shape)."""
    from transformers import LlamaConfig

    special = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    common = dict(
        architectures=["LlamaForCausalLM"],
        hidden_act="silu",
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=special[BOS],
        eos_token_id=[special[t] for t in EOS_TOKENS],
        pad_token_id=special[PAD],
    )
    if name == "demo":
        return LlamaConfig(
            vocab_size=4096,
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=32,
            max_position_embeddings=4096,
            rope_theta=10000.0,
            **common,
        )
    if name == "demo-135m":
        return LlamaConfig(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            max_position_embeddings=8192,
            rope_theta=100000.0,
            **common,
        )
    raise ValueError(f"unknown demo model {name!r} (choose from {', '.join(DEMO_MODELS)})")


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = SEED, std: float = 0.02) -> None:
    """Initialise like transformers (normal(0, std) matrices, unit norms, zero biases) from a fixed
    seed. Drawn on the CPU, so the weights are the same on every device and every run."""
    gen = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, RMSNorm | nn.LayerNorm):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Linear | nn.Embedding):
            weight = module.weight
            if weight.device.type == "cpu" and weight.dtype == torch.float32:
                weight.normal_(0.0, std, generator=gen)  # in place: no temporary for 135M values
            else:
                weight.copy_(torch.empty(weight.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
