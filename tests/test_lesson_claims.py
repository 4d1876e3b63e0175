"""What a fresh read of chapters 04, 05, 08e, 09a and 10 found wrong or misleading, kept from coming back: tables that
render, the cache window named W, the cost section saying which methods its stored run covers, and sentences that
stated something false."""
import json, re
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = ROOT/'nbs'


def _nb(name): return json.loads((NBS/name).read_text())

def _markdowns(nb:dict):
    "(cell index, Markdown) for every markdown cell and every `text/markdown` output."
    for i, c in enumerate(nb['cells']):
        if c['cell_type'] == 'markdown': yield i, ''.join(c['source'])
        for o in c.get('outputs', []):
            if 'text/markdown' in o.get('data', {}): yield i, ''.join(o['data']['text/markdown'])

def _cells_in_row(row:str) -> int:
    "Cells of a Markdown table row; `|` inside a formula, a code span or escaped does not separate cells."
    r = re.sub(r'(?<!\\)\$[^$]*?(?<!\\)\$', 'x', row)
    r = re.sub(r'`[^`]*`', 'x', r).replace('\\|', 'x').strip()
    return r.strip('|').count('|') + 1

def _tables(md:str):
    "Each Markdown table (header, delimiter, rows) outside code fences, as a list of its lines."
    md, block = re.sub(r'```.*?```', '', md, flags=re.S), []
    for line in md.splitlines() + ['']:
        if line.lstrip().startswith('|'): block.append(line.strip()); continue
        if len(block) >= 2 and re.match(r'^\|?\s*:?-{3,}', block[1]): yield block
        block = []

@pytest.mark.parametrize('nb', sorted(NBS.glob('*.ipynb')), ids=lambda p: p.name)
def test_markdown_tables_well_formed(nb):
    "Every row of every table has as many cells as its header: a row glued to the next one (`| — || ...`) makes the"
    " renderer print the whole table as raw text."
    bad = [f'cell {i}: header {_cells_in_row(t[0])} cells, row {_cells_in_row(r)}: {r[:60]}...'
           for i, md in _markdowns(json.loads(nb.read_text())) for t in _tables(md) for r in t[2:]
           if _cells_in_row(r) != _cells_in_row(t[0])]
    assert not bad, bad

def test_cache_window_is_W():
    "relpos.cache names the cache window W, as the notation table does; L is FIRE's threshold only."
    import inspect
    import relpos.cache as C
    for cls in (C.ALiBiMultiHeadAttention, C.T5MultiHeadAttention, C.XLRelativeMultiHeadAttention, C.KerpleMultiHeadAttention):
        assert list(inspect.signature(cls.cache_tables).parameters)[1] == 'W', cls
    src = (ROOT/'relpos'/'cache.py').read_text().replace(r'\\max(L, i)', '')   # FIRE's threshold, in its docstring
    assert not re.findall(r'.{30}(?<![A-Za-z_])L(?![A-Za-z_]).{10}', src)

def test_cache_cost_names_the_methods_it_lacks():
    "The cost section of 09a says which methods of POSITIONS its stored run does not cover."
    from relpos.models import POSITIONS
    bench = json.loads((NBS/'data'/'cache_bench.json').read_text())
    covered = {r['position'] for r in bench['table']}
    text = next(md for _, md in _markdowns(_nb('09a_cache.ipynb')) if 'as many tokens per second as the hidden-state memory' in md)
    assert f'covers {len(covered)} of the {len(POSITIONS)} methods' in text, text[:200]
    for p in POSITIONS:
        if p not in covered: assert f'`{p}`' in text, p

# (chapter, text a reader must not meet, why)
FALSE_OR_MISLEADING = [
    ('05_context_choice.ipynb', re.compile(r'\b[Tt]he\s+seed\b'),
     'the ported code is the chapter\'s "original code" (docs home); "seed" also means torch.manual_seed there'),
    ('05_context_choice.ipynb', re.compile(r'\{\|z\|\}|\$\|z\|\$ the number'), '|z| reads as an absolute value: the count of logits is Z'),
    ('05_context_choice.ipynb', re.compile(r'top-\$k\$|the \$k\$ \(key'), 'the number of retrieved pairs is K (k is a key vector)'),
    ('09a_cache.ipynb', re.compile(r'\\sum_f a_\{hf\}'), "meliad's series is written with waves u, alpha, beta (chapter 04); f is a rotary pair"),
    ('09a_cache.ipynb', re.compile(r'for every method with the cache'), 'the stored run does not cover every method'),
    ('04_fourier.ipynb', re.compile(r"times \$s_h\$ gives meliad's head\."), 'scaling row h gives only the bias term of a meliad head'),
    ('10_memorizing.ipynb', re.compile(r'16 XL windows'), 'the list is 16 segments away; an XL window (segment + memory) is 128 tokens'),
    ('10_memorizing.ipynb', re.compile(r'q \\cdot k_i\$'), 'i is the query position; the retrieved keys are k_l'),
    ('10_memorizing.ipynb', re.compile(r'A budget for a memory|within 3x|within 2x'), 'an internal target, not what the reader needs'),
]

@pytest.mark.parametrize('name,pattern,why', FALSE_OR_MISLEADING, ids=lambda x: getattr(x, 'pattern', str(x))[:30])
def test_fixed_sentences_stay_fixed(name, pattern, why):
    nb = _nb(name)
    texts = [(i, md) for i, md in _markdowns(nb)] + [
        (i, ''.join(o.get('text', ''))) for i, c in enumerate(nb['cells']) for o in c.get('outputs', [])] + [
        (i, ''.join(c['source'])) for i, c in enumerate(nb['cells']) if c['cell_type'] == 'code']
    hits = [f'cell {i}: ...{t[max(0, m.start() - 40):m.end() + 40]}...' for i, t in texts for m in pattern.finditer(t)]
    assert not hits, (why, hits)
