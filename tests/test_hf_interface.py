"""DecoderLM as transformers' tools call it, and the way back, in float64 against transformers (its float32 steps in
float64, see test_modern.float32_as_float64): the causal-LM forward (`input_ids=`, `labels=`: transformers' loss),
`generate` with transformers' arguments (the same tokens as `LlamaForCausalLM.generate` of the converted model),
`Trainer` and PEFT's LoRA on a relpos model, `save_pretrained`/`from_pretrained` for every position method, and
`to_transformers` (LLaMA and GPT-NeoX layouts, round trips, refusals)."""
import copy, inspect, json
import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import (LlamaConfig, LlamaForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM, LogitsProcessorList,
                          StoppingCriteriaList, MaxLengthCriteria, NoRepeatNGramLogitsProcessor)
from transformers.generation.streamers import BaseStreamer
from transformers.loss.loss_utils import ForCausalLMLoss

from relpos.models import DecoderLM, POSITIONS, POSITION_BUILDERS, CausalLMOutput, causal_lm_loss
from relpos.hf import decoder_to_transformers, TO_TRANSFORMERS
from test_modern import float32_as_float64, ROPES, max_err

TOL = 1e-10
V = 64


def tiny_llama(rope=None, kv_heads=2, tie=False, bias=False, seed=0):
    "A random LlamaForCausalLM in float64 with no special tokens (transformers' generate stops only where told)."
    with float32_as_float64():
        cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=16, rms_norm_eps=1e-6,
                          initializer_range=0.2,   # large weights: greedy decoding that does not repeat one token
                          tie_word_embeddings=tie, attention_bias=bias, mlp_bias=bias, bos_token_id=None,
                          eos_token_id=None, pad_token_id=None,
                          rope_parameters={**(rope or {'rope_type': 'default'}), 'rope_theta': 500.0})
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).double().eval()
    with torch.no_grad():   # RMSNorm weights start at 1: move them so that a misplaced norm weight shows
        for n, p in model.named_parameters():
            if 'norm' in n: p.add_(0.2 * torch.randn_like(p))
    return model


def tiny_neox(parallel=True, tie=False, seed=0):
    with float32_as_float64():
        cfg = GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            rotary_pct=0.5, max_position_embeddings=64, use_parallel_residual=parallel,
                            tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None)
        cfg._attn_implementation = 'sdpa'
        torch.manual_seed(seed)
        model = GPTNeoXForCausalLM(cfg).double().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'layernorm' in n or 'layer_norm' in n: p.add_(0.2 * torch.randn_like(p))
    return model


def hf_logits(model, tokens, **kw):
    with float32_as_float64(), torch.no_grad():
        return model(tokens, **kw).logits


def tokens(b, n, seed=0, vocab=V):
    return torch.randint(0, vocab, (b, n), generator=torch.Generator().manual_seed(seed))


def left_padded(b, n, pads):
    "attention_mask `[b, n]` with `pads[i]` leading zeros in row i."
    mask = torch.ones(b, n, dtype=torch.long)
    for i, p in enumerate(pads): mask[i, :p] = 0
    return mask


# ---------------------------------------------------------------- forward(input_ids=, labels=)
def test_forward_keywords_give_transformers_loss_and_logits():
    "The converted Llama called as transformers calls it: its loss (shifted labels, -100 ignored) and logits."
    model = tiny_llama()
    lm = DecoderLM.from_transformers(model)
    ids, mask = tokens(3, 12, seed=1), left_padded(3, 12, [0, 0, 0])
    mask[1, 9:] = 0                                   # right padding, not scored
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :4] = -100                              # a prompt not scored
    with float32_as_float64(), torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask, labels=labels)
        want_sum = model(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7))
        got = lm(input_ids=ids, attention_mask=mask, labels=labels)
        got_sum = lm(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=torch.tensor(7))
    assert isinstance(got, CausalLMOutput) and list(got) == ['loss', 'logits']
    assert abs(got.loss.item() - want.loss.item()) <= 1e-12 and abs(got_sum.loss.item() - want_sum.loss.item()) <= 1e-12
    assert max_err(got.logits, want.logits, mask.bool()) <= TOL
    # transformers' own loss function on relpos's logits, in float64
    with float32_as_float64():
        ref = ForCausalLMLoss(got.logits, labels, V)
    assert got.loss.dtype == torch.float64 and abs(got.loss.item() - ref.item()) <= 1e-14


def test_plain_call_is_unchanged_and_return_dict():
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=2, position='xl', mem_len=4).eval()
    x = tokens(2, 6)
    logits, memory = lm(x)                            # relpos's call: a tuple, memory included
    assert isinstance(logits, torch.Tensor) and len(memory) == 2 and memory[0].shape == (2, 4, 16)
    out = lm(input_ids=x, labels=x)
    assert torch.equal(out.logits, logits) and all(torch.equal(a, b) for a, b in zip(out.memory, memory))
    loss, logits2, memory2 = lm(input_ids=x, labels=x, return_dict=False)
    assert torch.equal(loss, out.loss) and torch.equal(logits2, logits)
    assert isinstance(lm(x, return_dict=True), CausalLMOutput)
    assert lm(input_ids=x).loss is None and lm(input_ids=x)[0] is not None


def test_loss_adds_the_knn_gate_loss():
    torch.manual_seed(0)
    a = DecoderLM(V, d_model=16, heads=2, n_layers=2, position='xl', mem_len=4, memorizing_layers=(1,), knn_capacity=16,
                  top_k=2)
    b = copy.deepcopy(a)
    x = tokens(2, 6)
    logits, _ = a(x)
    want = causal_lm_loss(logits, x) + a.get_loss_component()
    got = b(input_ids=x, labels=x).loss
    assert a.get_loss_component().item() == 0 and abs(got.item() - want.item()) <= 1e-6 and got.requires_grad


def test_forward_refusals_name_the_argument():
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=1, position='rotary')
    x = tokens(2, 5)
    with pytest.raises(ValueError, match=r"labels must have the shape of the tokens \(2, 5\)"): lm(input_ids=x, labels=x[:, :3])
    with pytest.raises(TypeError, match="labels must be an integer"): lm(input_ids=x, labels=x.float())
    with pytest.raises(ValueError, match=r"labels must be ids in \[0, n_vocab=64\) or -100"): lm(input_ids=x, labels=x - 5)
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['token_type_ids'\]"): lm(input_ids=x, token_type_ids=x)
    with pytest.raises(ValueError, match="output_attentions=True"): lm(input_ids=x, output_attentions=True)
    with pytest.raises(TypeError, match="tokens or input_ids=, not both"): lm(x, input_ids=x)
    with pytest.raises(TypeError, match="forward needs token ids"): lm()


# ---------------------------------------------------------------- generate with transformers' arguments
def both_generate(model, lm, prompt, mask, seed=None, **kw):
    "transformers' and relpos's `generate` with the same arguments (the same global seed before each when sampling)."
    out = []
    for f in (model.generate, lm.generate):
        with float32_as_float64(), torch.no_grad():
            if seed is not None: torch.manual_seed(seed)
            out.append(f(input_ids=prompt, attention_mask=mask, **kw))
    return out


@pytest.fixture(scope='module')
def llama_pair():
    model = tiny_llama(kv_heads=2, tie=True)
    return model, DecoderLM.from_transformers(model)


def test_greedy_with_eos_rows_stop_at_different_steps(llama_pair):
    model, lm = llama_pair
    prompt, mask = tokens(3, 6, seed=2), left_padded(3, 6, [0, 2, 4])
    full = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=12)
    # an EOS that row 0 emits early and the others emit later or never: rows finish at different steps
    new = full[:, 6:]
    step = lambda r, t: int((new[r] == t).nonzero()[0]) if (new[r] == t).any() else 99
    eos = next(int(t) for t in new[0, 1:5] if step(0, t) < min(step(1, t), step(2, t)) and step(0, t) > 0)
    theirs, ours = both_generate(model, lm, prompt, mask, max_new_tokens=12, eos_token_id=eos, pad_token_id=V - 1)
    assert torch.equal(ours, theirs), (ours, theirs)
    ends = [step(r, eos) for r in range(3)]
    assert ends[0] < min(ends[1:]) and (ours[0, 6 + ends[0] + 1:] == V - 1).all()
    # a list of EOS ids; pad defaults to the first
    theirs, ours = both_generate(model, lm, prompt, mask, max_new_tokens=12, eos_token_id=[eos, int(new[1, 3])])
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("use_cache", [True, False])
def test_repetition_penalty(llama_pair, use_cache):
    model, lm = llama_pair
    prompt = tokens(2, 8, seed=3)
    mask = left_padded(2, 8, [0, 3]) if use_cache else None   # relpos's uncached path takes no attention_mask
    theirs, ours = both_generate(model, lm, prompt, mask, max_new_tokens=10, repetition_penalty=1.8, use_cache=use_cache)
    plain = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=10, use_cache=use_cache)
    assert torch.equal(ours, theirs) and not torch.equal(ours, plain)   # the penalty changed something


@pytest.mark.parametrize("settings", [dict(top_k=10), dict(top_p=0.8, top_k=0), dict(temperature=0.7, top_k=20, top_p=0.9),
                                      dict(), dict(repetition_penalty=1.3, temperature=1.5)])
def test_sampling_with_the_same_seed(llama_pair, settings):
    "transformers samples with torch.multinomial on the global generator after the same processors: the same tokens."
    model, lm = llama_pair
    prompt, mask = tokens(4, 5, seed=4), left_padded(4, 5, [0, 1, 2, 0])
    draws = set()
    for seed in range(3):
        theirs, ours = both_generate(model, lm, prompt, mask, seed=seed, max_new_tokens=8, do_sample=True, **settings)
        assert torch.equal(ours, theirs), (settings, seed)
        draws.add(tuple(ours.flatten().tolist()))
    assert len(draws) == 3   # really sampled


def test_processors_criteria_and_streamer_objects(llama_pair):
    model, lm = llama_pair

    class Recorder(BaseStreamer):
        def __init__(self): self.puts, self.ended = [], 0
        def put(self, value): self.puts.append(value.clone())
        def end(self): self.ended += 1

    prompt, mask = tokens(2, 5, seed=5), left_padded(2, 5, [0, 1])
    recorders = Recorder(), Recorder()
    out = []
    for f, rec in zip((model.generate, lm.generate), recorders):
        with float32_as_float64(), torch.no_grad():
            out.append(f(input_ids=prompt, attention_mask=mask, max_new_tokens=20, streamer=rec,
                         logits_processor=LogitsProcessorList([NoRepeatNGramLogitsProcessor(1)]),
                         stopping_criteria=StoppingCriteriaList([MaxLengthCriteria(max_length=12)])))
    assert out[1].shape == (2, 12) and torch.equal(out[0], out[1])
    assert len(recorders[0].puts) == len(recorders[1].puts) == 8 and recorders[1].ended == 1
    assert all(torch.equal(a, b) for a, b in zip(*(r.puts for r in recorders)))
    plain = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=7)
    assert not torch.equal(plain, out[1])   # the processor changed something
    # plain callables do as well as transformers' lists
    stop_row0 = lambda ids, scores: torch.tensor([ids.shape[1] >= 8, False])
    got = lm.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=6, stopping_criteria=[stop_row0])
    assert got.shape == (2, 11)   # row 0 finished, row 1 did not: all 6 tokens (no EOS, so no padding, as transformers)


def test_default_is_greedy_only_for_transformers_calls():
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=2, position='rotary').eval()
    prompt = tokens(2, 4, seed=6)
    greedy = lm.generate(prompt, 6, temperature=0)
    assert torch.equal(lm.generate(input_ids=prompt, max_new_tokens=6), greedy)
    assert torch.equal(lm.generate(prompt, 6, do_sample=False), greedy)
    # relpos's call samples: the same draws as re-encoding the prefix and sampling its softmax
    g, h = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    sampled = lm.generate(prompt, 6, generator=g)
    ref = prompt
    with torch.no_grad():
        for _ in range(6):
            ref = torch.cat([ref, torch.multinomial(lm(ref)[0][:, -1].float().softmax(-1), 1, generator=h)], 1)
    assert torch.equal(sampled, ref) and not torch.equal(sampled, greedy)
    with pytest.warns(UserWarning, match="temperature=0.5 ignored"):
        assert torch.equal(lm.generate(prompt, 6, temperature=0.5, eos_token_id=V - 1), lm.generate(prompt, 6, temperature=0, eos_token_id=V - 1))


def test_generate_refusals():
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=1, position='rotary')
    p = tokens(1, 3)
    cases = [(dict(eos_token_id=V), ValueError, r"eos_token_id must be a token id or a list of token ids in \[0, n_vocab=64\)"),
             (dict(pad_token_id=-1), ValueError, "pad_token_id must be"),
             (dict(top_p=1.5), ValueError, r"top_p must be a float in \[0, 1\], got 1.5"),
             (dict(repetition_penalty=0), ValueError, "repetition_penalty must be a float > 0"),
             (dict(do_sample='yes'), TypeError, "do_sample must be a bool"),
             (dict(do_sample=True, temperature=0), ValueError, "temperature must be > 0 with do_sample=True"),
             (dict(streamer=object()), TypeError, r"streamer must have put\(tokens\) and end\(\)"),
             (dict(logits_processor=[3]), TypeError, "logits_processor must be a list of callables"),
             (dict(input_ids=p), TypeError, "prompt or input_ids=, not both")]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg): lm.generate(p, 2, **kw)
    with pytest.raises(TypeError, match="generate needs max_new_tokens"): lm.generate(input_ids=p)


# ---------------------------------------------------------------- Trainer and PEFT, unchanged
def lm_dataset(n=16, length=12, seed=0):
    "Rows where token t repeats token t - 4 (learnable), as a list of dicts: what a tokenised dataset yields."
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        head = torch.randint(0, V, (4,), generator=g)
        ids = head.repeat(length // 4)
        rows.append({'input_ids': ids, 'attention_mask': torch.ones_like(ids), 'labels': ids.clone()})
    return rows


def trainer_args(tmp_path, steps, lr):
    return transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=8,
                                          per_device_eval_batch_size=16, learning_rate=lr, logging_steps=1,
                                          report_to='none', save_strategy='no', use_cpu=True, disable_tqdm=True, seed=0)


def test_trainer_trains_a_relpos_model_as_it_trains_llama(tmp_path):
    "Trainer, unchanged, on a LLaMA and on its relpos conversion (float32): the same eval loss, the same training curve."
    pytest.importorskip("accelerate")   # Trainer needs it (peft, in the dev extras, installs it)
    with torch.no_grad():
        llama = tiny_llama().float()
    lm = DecoderLM.from_transformers(llama)
    train, evalset = lm_dataset(32), lm_dataset(16, seed=1)
    runs = {}
    for name, model in (('llama', llama), ('relpos', lm)):
        trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path / name, 12, 3e-3), train_dataset=train,
                                       eval_dataset=evalset)
        first = trainer.evaluate()['eval_loss']
        trainer.train()
        runs[name] = first, [h['loss'] for h in trainer.state.log_history if 'loss' in h], trainer.evaluate()['eval_loss']
    (first, curve, last), (first_hf, curve_hf, last_hf) = runs['relpos'], runs['llama']
    assert len(curve) == 12 and curve[-1] < 0.8 * curve[0] and last < first, runs   # it learns
    assert abs(first - first_hf) <= 1e-5 * first_hf and abs(last - last_hf) <= 1e-3 * last_hf, runs
    assert all(abs(a - b) <= 1e-3 * b for a, b in zip(curve, curve_hf)), runs
    # Trainer's eval loss is the model's own mean (it counts the scored tokens as labels[:, 1:]: DecoderLM.loss_type)
    batch = {k: torch.stack([r[k] for r in evalset]) for k in evalset[0]}
    with torch.no_grad(): own = lm.eval()(**batch).loss.item()
    assert abs(own - last) <= 1e-5 * last, (own, last)


def test_peft_lora_trains_a_relpos_model(tmp_path):
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lm = DecoderLM(V, d_model=32, heads=4, n_layers=2, position='rotary', norm='rms', ffn='swiglu', bias=False)
    base = {k: v.clone() for k, v in lm.state_dict().items()}
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=['query.linear', 'value.linear', 'gate',
                                                                                'layer1', 'layer2'])
    model = peft.get_peft_model(lm, lora)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all('lora_' in n for n in trainable)
    train = lm_dataset(32)
    trainer = transformers.Trainer(model=model, args=trainer_args(tmp_path, 16, 5e-2), train_dataset=train)
    trainer.train()
    losses = [h['loss'] for h in trainer.state.log_history if 'loss' in h]
    assert len(losses) == 16 and sum(losses[-4:]) < 0.9 * sum(losses[:4]), losses   # it learns
    for k, v in model.get_base_model().state_dict().items():   # the base weights did not move
        if 'lora_' not in k: assert torch.equal(v, base[k.replace('.base_layer', '')]), k
    x = tokens(2, 12, seed=3)
    with torch.no_grad():
        adapted = model.eval()(input_ids=x).logits
        merged = model.merge_and_unload()
        assert type(merged) is DecoderLM and not torch.equal(merged.state_dict()['layers.0.self_attn.module.query.linear.weight'],
                                                             base['layers.0.self_attn.module.query.linear.weight'])
        assert max_err(merged(x)[0], adapted) <= 1e-5


# ---------------------------------------------------------------- save_pretrained / from_pretrained
def perturbed(lm, seed=0):
    "Every parameter moved, so that a zero-initialised one (a bias, a table) that fails to load shows."
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lm.parameters(): p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return lm.eval()


def reload(lm, tmp_path, **kw):
    lm.save_pretrained(tmp_path)
    return DecoderLM.from_pretrained(tmp_path, **kw)


def same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) and sa[k].dtype == sb[k].dtype for k in sa)
    assert a.to_config() == b.to_config()


@pytest.mark.parametrize("position", POSITIONS)
def test_save_and_load_every_position(position, tmp_path):
    torch.manual_seed(0)
    lm = perturbed(DecoderLM(V, d_model=16, heads=2, n_layers=2, position=position, max_len=16))
    back = reload(lm, tmp_path)
    same_model(lm, back)
    x = tokens(2, 9)
    with torch.no_grad(): assert torch.equal(back(x)[0], lm(x)[0])


def module_level_builder(d_model, heads, dropout, max_len, mem_len, **kw):
    "A builder of one's own, importable: saved by its import path."
    return POSITION_BUILDERS['t5'](d_model, heads, dropout, max_len, mem_len, **kw)


class OwnLM(DecoderLM):
    "A subclass: from_pretrained builds the class it is called on."


@pytest.mark.parametrize("kw", [
    dict(position='xl', mem_len=6, memorizing_layers=(1,), knn_capacity=16, top_k=2, dropout=0.1),
    dict(position='rotary', norm='rms', ffn='swiglu', bias=False, kv_heads=1, head_dim=12, tie_embeddings=True,
         rope_scaling={'rope_type': 'longrope', 'factor': 4.0, 'original_max_position_embeddings': 8,
                       'short_factor': [1.0] * 6, 'long_factor': [2.0] * 6}, max_position_embeddings=32, nope_layers=(0,)),
    dict(position='fire', parallel_residual=True, head_bias=False, norm_eps=1e-6, attention_dropout=0.2, ffn_dropout=0.0),
    dict(position=module_level_builder, num_buckets=8, max_distance=16, mem_len=4),
], ids=['knn+xl memory', 'llama-like gqa longrope nope', 'fire parallel', 'own builder'])
def test_save_and_load_options(kw, tmp_path):
    "Options beyond the position: the next segments (XL memory, kNN memory from a fresh start) give identical logits."
    torch.manual_seed(0)
    lm = perturbed(DecoderLM(V, d_model=24, heads=2, n_layers=2, **kw)).double()
    back = reload(lm, tmp_path)
    same_model(lm, back)
    assert back.training is False and back.src_embed.weight.dtype == torch.float64
    if lm.tie_embeddings: assert back.generator.weight is back.src_embed.weight
    mem_a = mem_b = None
    with torch.no_grad():
        for seg in range(3):
            x = tokens(2, 5, seed=seg)
            (la, mem_a), (lb, mem_b) = lm(x, mem_a), back(x, mem_b)
            assert torch.equal(la, lb), seg


def test_save_and_load_faiss_memory_class(tmp_path):
    pytest.importorskip("faiss")
    from relpos.memorizing import FaissKNNMemory
    lm = DecoderLM(V, d_model=16, heads=2, n_layers=2, position='xl', mem_len=4, memorizing_layers=(0,),
                   knn_memory=FaissKNNMemory, knn_memory_kwargs=dict(nprobe=4))
    back = reload(lm, tmp_path)
    assert back.knn_memory is FaissKNNMemory and back.knn_memory_kwargs == {'nprobe': 4}


def test_config_records_every_constructor_argument(tmp_path):
    "A constructor argument added later must be written too, or a reloaded model would silently differ."
    lm = DecoderLM(V, d_model=16, heads=2, position='t5', num_buckets=8)
    params = set(inspect.signature(DecoderLM.__init__).parameters) - {'self', 'position_kwargs'}
    cfg = lm.to_config()
    assert params <= set(cfg) and set(cfg) - params == {'num_buckets'}
    lm.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / 'config.json').read_text())
    assert saved['library'] == 'relpos' and saved['init']['num_buckets'] == 8 and saved['init']['nope_layers'] == {'__tuple__': []}


def test_from_pretrained_builds_the_class_it_is_called_on_with_overrides(tmp_path):
    lm = perturbed(OwnLM(V, d_model=16, heads=2, position='alibi'))
    lm.save_pretrained(tmp_path)
    back = OwnLM.from_pretrained(tmp_path, dropout=0.25, device='cpu')
    assert type(back) is OwnLM and back.dropout_p == 0.25 and back.layers[0].dropout.p == 0.25


def test_save_and_load_refusals(tmp_path):
    local = DecoderLM(V, d_model=16, heads=2, position=lambda *a, **k: POSITION_BUILDERS['none'](*a, **k))
    with pytest.raises(ValueError, match="position=.* cannot be written to config.json"): local.save_pretrained(tmp_path / 'a')
    with pytest.raises(FileNotFoundError, match="has no config.json or model.safetensors"): DecoderLM.from_pretrained(tmp_path / 'b')
    hf = tiny_llama()
    hf.save_pretrained(tmp_path / 'hf')
    with pytest.raises(ValueError, match="was not written by relpos's save_pretrained"): DecoderLM.from_pretrained(tmp_path / 'hf')
    lm = DecoderLM(V, d_model=16, heads=2, position=module_level_builder)
    lm.save_pretrained(tmp_path / 'c')
    cfg = json.loads((tmp_path / 'c' / 'config.json').read_text())
    cfg['init']['position'] = {'__import__': 'no_such_module:builder'}
    (tmp_path / 'c' / 'config.json').write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="position is no_such_module:builder, which cannot be imported here"):
        DecoderLM.from_pretrained(tmp_path / 'c')
    assert type(DecoderLM.from_pretrained(tmp_path / 'c', position=module_level_builder)) is DecoderLM


# ---------------------------------------------------------------- to_transformers
def to_hf(lm, **kw):
    with float32_as_float64():   # transformers' rotary frequencies in float64, as relpos's
        return lm.to_transformers(**kw)


@pytest.mark.parametrize("rope", list(ROPES))
@pytest.mark.parametrize("kv_heads,tie,bias", [(2, True, False), (4, False, True)])
def test_llama_round_trip(rope, kv_heads, tie, bias):
    "LLaMA -> relpos -> LLaMA: every weight back in place, the same config, the same logits."
    model = tiny_llama(ROPES[rope], kv_heads, tie, bias)
    lm = DecoderLM.from_transformers(model)
    back = to_hf(lm)
    assert type(back) is LlamaForCausalLM and back.training == lm.training
    sa, sb = model.state_dict(), back.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    for k in ('num_key_value_heads', 'head_dim', 'rms_norm_eps', 'attention_bias', 'mlp_bias', 'tie_word_embeddings',
              'max_position_embeddings', 'rope_parameters'):
        assert getattr(back.config, k) == getattr(model.config, k), k
    x = tokens(2, 24, seed=7)   # longer than max_position_embeddings: the scaled ropes at work
    want = hf_logits(model, x)
    assert max_err(hf_logits(back, x), want) <= TOL
    with torch.no_grad(): assert max_err(lm(x)[0], want) <= TOL


@pytest.mark.parametrize("kw", [dict(), dict(bias=True, kv_heads=2, tie_embeddings=True),
                                dict(head_dim=12, kv_heads=1, base=10000.0, max_position_embeddings=64,
                                     rope_scaling={'rope_type': 'dynamic', 'factor': 2.0}),
                                dict(rope_scaling=ROPES['yarn_mscale'])])   # no max_position_embeddings: yarn does without
def test_relpos_llama_layout_to_transformers(kw):
    "A DecoderLM trained in relpos (here: random weights) in LLaMA's layout: transformers' logits equal relpos's."
    torch.manual_seed(0)
    lm = perturbed(DecoderLM(V, d_model=32, heads=4, n_layers=2, d_ff=40, position='rotary', norm='rms', ffn='swiglu',
                             head_bias=False, norm_eps=1e-6, **{'bias': False, **kw}).double())
    model = to_hf(lm)
    assert type(model) is LlamaForCausalLM and model.config.eos_token_id is None and not model.training
    x = tokens(3, 20, seed=8)
    mask = left_padded(3, 20, [0, 3, 0])
    ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        assert max_err(lm(x)[0], hf_logits(model, x)) <= TOL
        got = lm(x, attention_mask=mask, position_ids=ids)[0]
    assert max_err(got, hf_logits(model, x, attention_mask=mask, position_ids=ids), mask.bool()) <= TOL
    if lm.tie_embeddings: assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("tie", [False, True])
def test_gpt_neox_round_trip(parallel, tie):
    model = tiny_neox(parallel, tie)
    lm = DecoderLM.from_transformers(model)
    back = to_hf(lm)
    assert type(back) is GPTNeoXForCausalLM and back.config.use_parallel_residual == parallel
    sa, sb = model.state_dict(), back.state_dict()
    assert list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)
    x = tokens(2, 20, seed=9)
    want = hf_logits(model, x)
    assert max_err(hf_logits(back, x), want) <= TOL
    # and a relpos model in GPT-NeoX's layout, converted the other way first
    torch.manual_seed(1)
    native = perturbed(DecoderLM(V, d_model=32, heads=4, n_layers=2, position='rotary', rotary_dim=2, norm='layer',
                                 ffn='gelu', head_bias=False, parallel_residual=parallel, tie_embeddings=tie).double())
    with torch.no_grad(): assert max_err(hf_logits(to_hf(native), x), native(x)[0]) <= TOL


def test_to_transformers_keeps_dtype_mode_and_seed():
    lm = DecoderLM(V, d_model=16, heads=2, position='rotary', norm='rms', ffn='swiglu', bias=False, head_bias=False)
    state = torch.get_rng_state()
    model = lm.train().to_transformers(eos_token_id=3)
    assert torch.equal(torch.get_rng_state(), state)   # the throwaway initialisation used a forked generator
    assert model.training and model.dtype == torch.float32 and model.config.eos_token_id == 3


@pytest.mark.parametrize("position", POSITIONS)
def test_to_transformers_refuses_other_positions_by_name(position):
    lm = DecoderLM(V, d_model=16, heads=2, position=position, max_len=8)
    # GPT-2 has learned absolute positions, BLOOM ALiBi: a default DecoderLM (ReLU block) is refused by those classes
    own = {'rotary': 'LlamaForCausalLM', 'absolute': 'GPT2LMHeadModel', 'alibi': 'BloomForCausalLM'}
    msg = f"{own[position]} needs" if position in own else f"position='{position}' has no transformers counterpart"
    with pytest.raises(ValueError, match=msg): lm.to_transformers()


def test_to_transformers_refuses_what_no_class_expresses():
    rotary = dict(position='rotary', d_model=16, heads=2, n_layers=2)
    cases = [(dict(nope_layers=(1,)), r"GPTNeoXForCausalLM needs nope_layers=\(1,\) \(needs \(\)\)"),
             (dict(memorizing_layers=(0,)), r"memorizing_layers=\(0,\) has no counterpart"),
             (dict(norm='layer', ffn='swiglu'), "LlamaForCausalLM needs norm='layer' \\(needs 'rms'\\), head_bias=True .*"
                                                "GPTNeoXForCausalLM needs ffn='swiglu' \\(needs 'gelu'\\)"),
             (dict(norm='rms', ffn='swiglu', head_bias=False, bias=False, dropout=0.1), "residual_dropout=0.1 \\(needs 0.0\\), ffn_dropout=0.1"),
             (dict(norm='rms', ffn='swiglu', head_bias=False, interleaved=True), "interleaved=True \\(needs False\\)")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg): DecoderLM(V, **{**rotary, **kw}).to_transformers()
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['hidden_act'\]"):
        DecoderLM(V, **rotary).to_transformers(hidden_act='gelu')
    # dropout in more places than LLaMA's: converted when only inference matters
    lm = DecoderLM(V, **rotary, norm='rms', ffn='swiglu', head_bias=False, bias=False, dropout=0.1).eval()
    model = lm.to_transformers(ignore_dropout=True)
    assert model.config.attention_dropout == 0.1
    x = tokens(1, 6)
    with torch.no_grad(): assert max_err(model(x).logits, lm(x)[0]) <= 1e-5
    from relpos.hf import MODEL_CONVERTERS
    assert set(TO_TRANSFORMERS) == set(MODEL_CONVERTERS)   # a way back for every family that converts
