"Build the offline docs site once (tools/render_docs.py into a temp dir) and check what a reader needs."
import fcntl, html, json, re, subprocess, sys
from pathlib import Path
from types import SimpleNamespace
import pytest

ROOT = Path(__file__).resolve().parent.parent
NBS = sorted(p for p in (ROOT/'nbs').glob('*.ipynb') if not p.name.startswith(('_', '.')))
sys.path.insert(0, str(ROOT/'tools'))
import render_docs


# No time limit per notebook (`--timeout 0`): how long nbdev takes on a notebook depends on the machine's load, and a
# test that a busy machine fails is a benchmark. A notebook that hangs hangs the test run, where CI's job limit ends it.
RENDER_ARGS = ['--timeout', '0', '-q']


def _build(out):
    r = subprocess.run([sys.executable, str(ROOT/'tools'/'render_docs.py'), '--out', str(out), *RENDER_ARGS],
                       cwd=ROOT, capture_output=True, text=True)
    return SimpleNamespace(returncode=r.returncode, stderr=r.stderr)


def test_build_does_not_depend_on_load(tmp_path, monkeypatch):
    "The tests' build keeps a notebook however long it takes: here each look at the clock sees 1000 s more pass."
    import argparse, time
    ap = argparse.ArgumentParser(); ap.add_argument('--timeout', type=float, default=180); ap.add_argument('-q', action='store_true')
    timeout = ap.parse_args(RENDER_ARGS).timeout
    nb = tmp_path/'slow.ipynb'
    nb.write_text(json.dumps({'cells': [{'cell_type': 'markdown', 'metadata': {}, 'source': '# Slow\n\n> a page'},
                                        {'cell_type': 'code', 'metadata': {}, 'execution_count': None, 'outputs': [],
                                         'source': 'x = 1'}],
                              'metadata': {'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}},
                              'nbformat': 4, 'nbformat_minor': 5}))
    clock = iter(range(0, 10**9, 1000))
    monkeypatch.setattr(render_docs, 'time', SimpleNamespace(time=lambda: float(next(clock)), sleep=time.sleep))
    [r] = render_docs.run_workers([(str(nb), None, str(ROOT))], 1, timeout)
    assert r['error'] is None, r['error']


@pytest.fixture(scope='session')
def site(tmp_path_factory, worker_id):
    "The site, built once per run: under pytest-xdist the first worker builds it, the others wait and reuse it."
    if worker_id == 'master':
        out = tmp_path_factory.mktemp('docs')/'_docs'
        r = _build(out)
    else:
        shared = tmp_path_factory.getbasetemp().parent   # this run's temp dir, common to all workers
        out, res = shared/'docs'/'_docs', shared/'docs'/'result.json'
        (shared/'docs').mkdir(exist_ok=True)
        with open(shared/'docs'/'.lock', 'w') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not res.exists(): res.write_text(json.dumps(vars(_build(out))))
            r = SimpleNamespace(**json.loads(res.read_text()))
    assert (out/'index.html').exists(), r.stderr[-3000:]
    return out, r


def _nb(p): return json.loads(p.read_text())
def _has(p, pred): return any(pred(c, o) for c in _nb(p)['cells'] for o in c.get('outputs', []))


def test_every_notebook_processed(site):
    out, r = site
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.name)
def test_page_exists_with_title(site, nb):
    out, _ = site
    page = out/(nb.stem + '.html')
    assert page.exists()
    text = page.read_text()
    title = render_docs.split_frontmatter(_nb(nb))[0].get('title') or nb.stem
    h1 = re.search(r'<h1 class="title">(.*?)</h1>', text, re.S).group(1)
    assert re.sub(r'<[^>]+>|[`*_]', '', h1).strip() == re.sub(r'[`*_]', '', title).strip()


@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.name)
def test_math_offline(site, nb):
    out, _ = site
    text = (out/(nb.stem + '.html')).read_text()
    assert not re.search(r'(src|href)="(https?:)?//[^"]*(cdn|mathjax|unpkg|jsdelivr|googleapis)', text, re.I)
    assert not re.search(r'https?://[^"\s]*(cdnjs|jsdelivr|unpkg|mathjax\.org)', text, re.I)
    if any('$' in ''.join(c['source']) for c in _nb(nb)['cells'] if c['cell_type'] == 'markdown'):
        m = re.search(r'<script[^>]*src="(mathjax/MathJax\.js)[^"]*"', text)
        assert m and (out/m.group(1)).exists()
        assert (out/'mathjax'/'config'/'TeX-AMS-MML_HTMLorMML-full.js').exists()


@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.name)
def test_images_embedded(site, nb):
    out, _ = site
    if not _has(nb, lambda c, o: c['cell_type'] == 'code' and 'image/png' in o.get('data', {})): pytest.skip('no plots')
    assert re.search(r'<img[^>]+src="data:image/png;base64,', (out/(nb.stem + '.html')).read_text())


def _plain(text) -> str: return re.sub(r'\x1b\[[0-9;]*m', '', ''.join(text)).strip()

def _pre_texts(page):
    "Text of every `<pre>` block of a page, as a reader sees it."
    return {html.unescape(re.sub(r'<[^>]+>', '', m)).strip() for m in re.findall(r'<pre[^>]*>(.*?)</pre>', page, re.S)}


@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.name)
def test_text_outputs_shown_as_text(site, nb):
    "Printed output and plain results appear as the text they are (not as the list of lines the .ipynb stores)."
    out, _ = site
    want = []
    for c in _nb(nb)['cells']:
        if c['cell_type'] != 'code': continue
        d, _src = render_docs.split_directives(''.join(c['source']))
        if d.keys() & {'hide', 'export', 'exports', 'exporti', 'hide_output'} or any(
                render_docs._false(d.get(k, 'true')) for k in ('include', 'output')): continue
        # consecutive stdout pieces: shown one by one from the stored outputs, or as one text where the page re-ran the cell
        raw = []
        for o in c.get('outputs', []) + [{}]:
            if o.get('output_type') == 'stream' and o.get('name') == 'stdout':
                raw.append(''.join(o['text'])); continue
            if _plain(''.join(raw)): want.append(([_plain(t) for t in raw if _plain(t)], _plain(''.join(raw))))
            raw = []
            if o.get('output_type') == 'execute_result' and set(o.get('data', {})) == {'text/plain'}:
                if t := _plain(o['data']['text/plain']): want.append(([t], t))
    if not want: pytest.skip('no text outputs')
    pres = _pre_texts((out/(nb.stem + '.html')).read_text())
    missing = [whole for pieces, whole in want if whole not in pres and not all(t in pres for t in pieces)]
    assert not missing, missing[:3]


def test_no_quarto_attributes_left(site):
    "Quarto `{...}` attributes (nbdev's show_doc `source` links carry some) are turned into HTML or dropped."
    out, _ = site
    for page in out.glob('*.html'):
        text = re.sub(r'<pre[^>]*>.*?</pre>', '', page.read_text(), flags=re.S)
        assert not re.search(r'</a>\{|\{(target|style)=', text), page.name


def test_index_links_every_chapter(site):
    out, _ = site
    text = (out/'index.html').read_text()
    links = set(re.findall(r'href="([^"#:]+\.html)(?:#[^"]*)?"', text))
    for nb in NBS: assert nb.stem + '.html' in links, nb.name
    for l in links: assert (out/l).exists(), l
    assert '.ipynb"' not in text


def test_readme_deterministic():
    if not (ROOT/'nbs'/'index.ipynb').exists(): pytest.skip('no index.ipynb')
    a, b = render_docs.readme_text(), render_docs.readme_text()
    assert a == b and a.startswith('# ') and '\n> ' in a and '---\n' not in a.split('\n\n')[0]


def _pages(out): return sorted(out.glob('*.html'))


def test_internal_links_resolve(site):
    "Every `#frag` and `page.html#frag` link of the site scrolls somewhere: the fragment is an id of that page."
    out, _ = site
    ids = {p.name: set(re.findall(r'\bid="([^"]+)"', p.read_text())) for p in _pages(out)}
    bad = []
    for p in _pages(out):
        for page, frag in re.findall(r'href="((?:[^"#:/?]+\.html)?)#([^"]*)"', p.read_text()):
            page = page or p.name
            if page not in ids: bad.append(f'{p.name}: {page}#{frag} (no such page)')
            elif frag and frag not in ids[page]: bad.append(f'{p.name}: {page}#{frag}')
    assert not bad, f'{len(bad)} links to missing ids: {bad[:8]}'


def test_no_torch_base_docstrings(site):
    "A method without a docstring of its own shows torch's reST (`nn.Module.forward`'s 'Should be overridden...')."
    out, _ = site
    for p in _pages(out):
        text = html.unescape(p.read_text())
        for raw in ('Should be overridden by all subclasses', '.. note::', ':class:`', ':meth:`', ':func:`'):
            assert raw not in text, f'{p.name}: {raw!r}'


def test_no_escaped_underscore_in_math_text(site):
    r"Inside `\text{}` MathJax shows `\_` as a backslash and an underscore; write `\text{head_dim}`."
    out, _ = site
    for p in _pages(out):
        text = html.unescape(re.sub(r'<pre[^>]*>.*?</pre>', '', p.read_text(), flags=re.S))
        bad = re.findall(r'\\(?:text|textrm|textit|textbf|texttt|mbox)\{[^{}]*\\_[^{}]*\}', text)
        assert not bad, f'{p.name}: {bad[:3]}'


def test_long_pages_have_contents(site):
    "Pages with many sections get an 'On this page' list whose links are the page's headings."
    out, _ = site
    for nb in NBS:
        text = (out/(nb.stem + '.html')).read_text()
        n_sections = len(re.findall(r'<h[23][\s>]', text))
        toc = re.search(r'<nav class="toc".*?</nav>', text, re.S)
        if n_sections >= 4:
            assert toc, nb.name
            assert len(re.findall(r'<li', toc.group(0))) == n_sections
        else: assert not toc, nb.name


# ---------------------------------------------------------------------------------------------- what a reader sees

from html.parser import HTMLParser

class _ReaderText(HTMLParser):
    "Text of a page as a reader sees it, outside code-cell inputs, scripts and styles."
    VOID = {'br', 'img', 'meta', 'link', 'hr', 'input', 'source', 'wbr'}
    def __init__(self):
        super().__init__(convert_charrefs=True); self.skip, self.runs = [], []
    def handle_starttag(self, tag, attrs):
        if tag in self.VOID: return
        cls = (dict(attrs).get('class') or '').split()
        self.skip.append(bool(self.skip and self.skip[-1]) or tag in ('script', 'style') or 'input_area' in cls)
    def handle_endtag(self, tag):
        if tag not in self.VOID and self.skip: self.skip.pop()
    def handle_data(self, data):
        if not (self.skip and self.skip[-1]): self.runs.append(data)

def _reader_text(page):
    p = _ReaderText(); p.feed(page); return ''.join(p.runs)

_RAW_LINK = re.compile(r'\[[^\]\n]{1,120}\]\((?:https?://|[\w./-]+\.(?:html|ipynb)\b)[^)\s]*\)')
_TEX = re.compile(r'[A-Za-z]\w*_\{[^}\n]*\}|\\(?:frac|sqrt|operatorname|mathrm|mathbf|mathcal|text|cdot|sum|theta|alpha|sigma)\b')

def _raw_tex(text):
    "TeX outside `$...$` / `$$...$$` (which MathJax typesets): shown to the reader as it is."
    text = re.sub(r'\$\$.*?\$\$', '', text, flags=re.S)
    return _TEX.findall(re.sub(r'(?<!\\)\$[^$]+?(?<!\\)\$', '', text))

def test_reader_text_helpers_find_the_defects():
    page = ('<div class="input_area"><pre>[`x`](https://a.b/c.html) W_{k,R}</pre></div>'
            '<p>see [`alibi_slopes`](https://relpos.github.io/relpos/alibi.html#alibi_slopes) and <code>W_{k,R}</code>, '
            'not $W_{k,R}$ or $$\\frac{a}{b}$$</p>')
    text = _reader_text(page)
    assert _RAW_LINK.findall(text) == ['[`alibi_slopes`](https://relpos.github.io/relpos/alibi.html#alibi_slopes)']
    assert _raw_tex(text) == ['W_{k,R}']

def test_no_raw_markdown_links_or_tex_on_pages(site):
    "Link syntax or TeX that reaches the reader unrendered (nbdev links inside show_doc's signatures, TeX in code spans)."
    out, _ = site
    bad = {}
    for p in _pages(out):
        text = _reader_text(p.read_text())
        found = _RAW_LINK.findall(text) + _raw_tex(text)
        if found: bad[p.name] = found[:3]
    assert not bad, bad

# a warning's `Category: message` line, local file system paths, and transformers' log line about its attention dispatch
_NOISE = re.compile(r'\w*Warning: |/work/|/home/|/tmp/|/site-packages/|\.venv/|You tried to access')

@pytest.mark.parametrize('nb', NBS, ids=lambda p: p.name)
def test_stored_outputs_have_no_noise(nb):
    "Warnings, local paths and library log lines in stored outputs: silence them where they start, in the notebook."
    bad = []
    for i, c in enumerate(_nb(nb)['cells']):
        for o in c.get('outputs', []):
            text = ''.join(o.get('text', '')) + ''.join(''.join(v) for k, v in o.get('data', {}).items() if k.startswith('text/'))
            bad += [f'cell {i}: ...{text[max(0, m.start() - 60):m.end() + 60]}...' for m in _NOISE.finditer(text)]
    assert not bad, bad[:3]

def test_models_registry_table_lists_every_position():
    "Chapter 09's registry table is generated from the registry: one row per entry of POSITIONS."
    from relpos.models import POSITIONS
    tables = [''.join(o['data']['text/markdown']) for c in _nb(ROOT/'nbs'/'09_models.ipynb')['cells'] for o in c.get('outputs', [])
              if '| `position` |' in ''.join(o.get('data', {}).get('text/markdown', ''))]
    assert len(tables) == 1
    rows = [l.split('|')[1].strip() for l in tables[0].splitlines()[2:] if l.startswith('|')]
    assert rows == [f"`'{p}'`" for p in POSITIONS]

def _cells(page):
    "(kind, html) of each notebook cell of a rendered page, in order."
    parts = re.split(r'<div class="cell border-box-sizing (text_cell|code_cell)\b[^"]*">', page)
    return list(zip(parts[1::2], parts[2::2]))

def _unannounced(page):
    "Text cells ending in ':' whose next cell shows nothing (no code input, no output), or that end the page."
    cells, bad = _cells(page), []
    for i, (kind, body) in enumerate(cells):
        text = html.unescape(re.sub(r'<[^>]+>', '', body)).strip()
        if kind != 'text_cell' or not text.endswith(':'): continue
        nxt_kind, nxt = cells[i + 1] if i + 1 < len(cells) else (None, '')
        if nxt_kind != 'code_cell' or not re.search(r'class="[^"]*\b(input_area|output_area)\b', nxt): bad.append(text[-80:])
    return bad

def test_unannounced_finds_the_defect():
    text = lambda t: f'<div class="cell border-box-sizing text_cell rendered"><p>{t}</p></div>'
    code = lambda inner: f'<div class="cell border-box-sizing code_cell rendered">{inner}</div>'
    assert _unannounced(text('The code that wires it in:') + text('## Memory')) == ['The code that wires it in:']
    assert _unannounced(text('Then:') + code('')) == ['Then:'] and _unannounced(text('At the end:')) == ['At the end:']
    assert _unannounced(text('Here:') + code('<div class="output_area">x</div>') + text('no colon.')) == []

def test_no_announcement_without_what_it_announces(site):
    "A text cell ending in ':' is followed by something to read: code or an output, not a heading, text or nothing."
    out, _ = site
    bad = [f'{p.name}: ...{t}' for p in _pages(out) for t in _unannounced(p.read_text())]
    assert not bad, bad

def test_readme_links_work_without_the_pages_site():
    "README links to chapters point at the notebooks (present in every clone), and its addresses come from settings.ini."
    text = (ROOT/'README.md').read_text()
    cfg = render_docs.read_settings()
    doc_url = cfg['doc_host'] + cfg['doc_baseurl']
    assert doc_url not in text
    for target in re.findall(r'\]\((nbs/[^)#\s]+)', text): assert (ROOT/target).exists(), target
    assert f"pip install git+{cfg['git_url']}" in text
    assert 'example.com' not in text + (ROOT/'settings.ini').read_text()


def test_slow_cells_import_nothing():
    "nbdev's doc processing executes every code cell that imports: a `#| slow` cell (a benchmark, the study) that imports"
    " would run whenever the site is built, and rewrite its stored results. Its imports belong in the chapter's import cell."
    bad = []
    for nb in NBS:
        for i, c in enumerate(_nb(nb)['cells']):
            src = ''.join(c['source'])
            if c['cell_type'] == 'code' and src.lstrip().startswith('#| slow') and re.search(r'^\s*(import|from)\s', src, re.M):
                bad.append(f'{nb.name} cell {i}')
    assert not bad, bad


def test_inline_math_has_no_big_delimiters():
    "The offline MathJax copy stops typesetting a page at an inline `\\big(`: every later formula on it shows as raw TeX."
    bad = []
    for nb in NBS:
        for i, c in enumerate(_nb(nb)['cells']):
            if c['cell_type'] != 'markdown': continue
            text = re.sub(r'\$\$.*?\$\$', '', ''.join(c['source']), flags=re.S)
            bad += [f'{nb.name} cell {i}: {m}' for m in re.findall(r'(?<!\\)\$[^$]+?(?<!\\)\$', text) if re.search(r'\\[bB]ig', m)]
    assert not bad, bad[:5]


# ---------------------------------------------------------------------------------------------- lesson-shaped chapters
# A method chapter is a lesson: the idea and a picture, each equation beside the code computing it, what the method does
# to attention, equality with its reference, a published number, how to use it with its cost, and only then a last
# section "Making it fast". The chapters listed here are in that shape; the others join the list as they are rewritten.

LESSONS = [ROOT/'nbs'/n for n in ('00_shift.ipynb', '01_mha.ipynb', '02_relative_mha.ipynb', '03_shaw.ipynb', '03b_bias.ipynb',
                                     '04_fourier.ipynb', '05_context_choice.ipynb', '06_rotary.ipynb', '06b_xpos.ipynb',
                                     '07_alibi.ipynb', '08_t5.ipynb', '08b_fire.ipynb', '08c_kerple.ipynb', '08d_fox.ipynb',
                                     '09a_cache.ipynb', '10_memorizing.ipynb', '08e_cope.ipynb')]
FAST_HEADING = 'Making it fast'
MAX_PARAGRAPH_WORDS = 100
# lab-notebook material: internal targets, tracker references, machine load, counts of repeated runs
LAB_PHRASES = re.compile(r'load average|\bissues?\b|\baim(s|ed)?\b|\brun \d+ of \d+', re.I)


def _paragraphs(md:str) -> list:
    "Paragraphs of Markdown prose as a reader meets them: each run of text lines, each list item on its own; headings,"
    " tables, display math (`$$...$$`), code fences and block quotes of the title cell left out."
    md = re.sub(r'```.*?```', '', md, flags=re.S)
    md = re.sub(r'\$\$.*?\$\$', ' $x$ ', md, flags=re.S)
    out, cur = [], []
    def flush():
        if cur: out.append(' '.join(cur)); cur.clear()
    for line in md.splitlines():
        s = line.strip()
        if not s or s.startswith(('#', '|', '>')): flush(); continue
        if re.match(r'([*+-]|\d+\.)\s', s): flush()
        cur.append(s)
    flush()
    return out

def _words(paragraph:str) -> int:
    "Words of a paragraph; a formula `$...$` counts as one word and a link as its text."
    p = re.sub(r'(?<!\\)\$[^$]+?(?<!\\)\$', 'x', paragraph)
    p = re.sub(r'\]\([^)\s]*\)', ']', p)
    return len(p.split())

def _prose(nb:dict):
    "(where, text) of every Markdown cell and every Markdown output (generated prose) of a notebook."
    for i, c in enumerate(nb['cells']):
        if c['cell_type'] == 'markdown': yield f'cell {i}', ''.join(c['source'])
        for o in c.get('outputs', []):
            md = o.get('data', {}).get('text/markdown')
            if md: yield f'cell {i} output', ''.join(md)

def test_paragraph_helpers_find_the_defects():
    md = ("# Title\n> a description\n\nOne two three $a + b = c$ four.\nStill the same paragraph.\n\n"
          "| a | b |\n|---|---|\n| 1 | 2 |\n\n* item one\n* item [two](https://x.y/z)\n\n$$\\sum_f x_f$$\n\n```py\ncode here\n```")
    ps = _paragraphs(md)
    assert ps == ['One two three $a + b = c$ four. Still the same paragraph.', '* item one', '* item [two](https://x.y/z)', '$x$']
    assert [_words(p) for p in ps] == [9, 3, 3, 1]
    assert LAB_PHRASES.search('the 1-minute load average') and LAB_PHRASES.search('The aim is 5%')
    assert LAB_PHRASES.search('run 1 of 3') and LAB_PHRASES.search('see issue 12')
    assert not LAB_PHRASES.search('the claim holds; every run of the layer; the tissue')
    assert _symbol('*d*<sub>k</sub>') == _symbol('$d_k$') == 'dk' and _symbol('*r* = *j* − *i*') == 'r=j-i'

@pytest.mark.parametrize('nb', LESSONS, ids=lambda p: p.name)
def test_lesson_paragraphs_short(nb):
    "Every paragraph of a lesson, written or generated, reads in one breath: at most ~100 words."
    long = [f'{where}: {_words(p)} words: {p[:80]}...' for where, md in _prose(_nb(nb)) for p in _paragraphs(md)
            if _words(p) > MAX_PARAGRAPH_WORDS]
    assert not long, long

@pytest.mark.parametrize('nb', LESSONS, ids=lambda p: p.name)
def test_lesson_has_no_lab_notebook_phrases(nb):
    "Aims, tracker issues, load averages and run counts belong to the benchmark chapter and the stored data, not a lesson."
    bad = [f'{where}: ...{md[max(0, m.start() - 50):m.end() + 50]}...' for where, md in _prose(_nb(nb))
           for m in LAB_PHRASES.finditer(md)]
    assert not bad, bad

def _h2(c): return re.findall(r'^##\s+(.*?)\s*$', ''.join(c['source']), re.M) if c['cell_type'] == 'markdown' else []

@pytest.mark.parametrize('nb', LESSONS, ids=lambda p: p.name)
def test_lesson_shape(nb):
    "A picture (an image output) before the last section, 'Making it fast', which holds the fast path and the benchmark."
    cells = _nb(nb)['cells']
    heads = [(i, h) for i, c in enumerate(cells) for h in _h2(c)]
    assert heads and heads[-1][1] == FAST_HEADING, f'last section: {heads[-1:]}, want {FAST_HEADING!r}'
    fast = heads[-1][0]
    assert any('image/png' in o.get('data', {}) for c in cells[:fast] for o in c.get('outputs', [])), 'no picture before it'
    engineering = [i for i, c in enumerate(cells) if c['cell_type'] == 'code'
                   and re.search(r'run_bench\(|def attention_fast\b|autograd\.Function', ''.join(c['source']))]
    assert engineering and min(engineering) > fast, f'fast path or benchmark in cells {engineering}, before cell {fast}'

_NOTATION_SYMBOLS = ('i', 'j', 'r=j-i', 'n', 'dk', 'H', 'T', 'N', 'W')

def _symbol(cell:str) -> str:
    "A table cell's symbol, however it is written: `$d_k$`, `*d*<sub>k</sub>` and `d_k` are all 'dk'."
    return re.sub(r'</?sub>|[$*_{}\\\s]', '', cell).replace('−', '-')

def test_notation_table_on_docs_home():
    "The docs home holds the one notation table the chapters follow."
    cells = [''.join(c['source']) for c in _nb(ROOT/'nbs'/'index.ipynb')['cells'] if c['cell_type'] == 'markdown']
    table = next((c for c in cells if re.search(r'^##\s+Notation\s*$', c, re.M)), None)
    assert table is not None, 'no "## Notation" section on the docs home'
    rows = [l for l in table.splitlines() if l.startswith('|')]
    firsts = [_symbol(l.split('|')[1]) for l in rows[2:]]
    missing = [s for s in _NOTATION_SYMBOLS if s not in firsts]
    assert not missing, f'notation table lacks {missing}; its symbols: {firsts}'
    assert len(firsts) == len(set(firsts)), 'a symbol defined twice'
    assert (ROOT/'README.md').read_text().count('## Notation') == 1

# symbols the notation table gives one meaning: a lesson may not use them for another
_REDEFINED = {r'e^{i': '`i` is the query position, not the imaginary unit (write cos/sin)',
              r'\theta_d': 'the rotary frequency index is f: theta_f',
              r'$L$': 'L is FIRE\'s threshold only; the training length is T',
              r'h^{n': 'n is the sequence length; write a layer index as \\ell'}

@pytest.mark.parametrize('nb', LESSONS, ids=lambda p: p.name)
def test_lesson_follows_notation(nb):
    bad = [f'{where}: {s!r}: {why}' for where, md in _prose(_nb(nb)) for s, why in _REDEFINED.items() if s in md.replace(' ', '')]
    assert not bad, bad


# ---------------------------------------------------------------------------------------------- the docs home and the guides
# Short pages for what a user looks for first (transformers and generate, GPU, DDP/FSDP2, which method), linked from
# the docs home and the sidebar. The home and the guides follow the lessons' rules for prose.

HOME = ROOT/'nbs'/'index.ipynb'
GUIDES = sorted((ROOT/'nbs').glob('g[0-9]*_*.ipynb'))

def _markdown(nb:dict) -> str: return '\n\n'.join(''.join(c['source']) for c in nb['cells'] if c['cell_type'] == 'markdown')

def test_guides_linked_from_home_and_sidebar():
    "Each guide is linked from the docs home (and so from the README) and listed in the sidebar."
    assert {g.stem.split('_', 1)[1] for g in GUIDES} >= {'generate', 'gpu', 'distributed', 'which_method'}, GUIDES
    home, readme = _markdown(_nb(HOME)), (ROOT/'README.md').read_text()
    sidebar = re.findall(r'[\w.-]+\.ipynb', (ROOT/'nbs'/'sidebar.yml').read_text())
    for g in GUIDES:
        assert f']({g.name})' in home, f'{g.name} is not linked from the docs home'
        assert f'](nbs/{g.name})' in readme, f'{g.name} is not linked from README.md (render_docs.py --readme)'
        assert g.name in sidebar, f'{g.name} is not in nbs/sidebar.yml'

@pytest.mark.parametrize('nb', GUIDES + [HOME], ids=lambda p: p.name)
def test_guide_and_home_prose(nb):
    "Paragraphs of at most ~100 words and no lab-notebook phrases (on the home: its own text; its generated summaries come from the chapters)."
    prose = [('markdown', _markdown(_nb(nb)))] if nb == HOME else list(_prose(_nb(nb)))
    long = [f'{w}: {_words(p)} words: {p[:80]}...' for w, md in prose for p in _paragraphs(md) if _words(p) > MAX_PARAGRAPH_WORDS]
    lab = [f'{w}: ...{md[max(0, m.start() - 50):m.end() + 50]}...' for w, md in prose for m in LAB_PHRASES.finditer(md)]
    assert not long and not lab, long + lab

def test_cost_tables_list_every_position():
    "Chapter 09's stored cost tables, and the docs home's table made from them (and the README's), have a row for every"
    " entry of POSITIONS: a method added to the registry without re-running the benchmark fails here."
    from relpos.models import POSITIONS
    from relpos.bench import stored_tables
    step, train, infer = stored_tables(ROOT/'nbs'/'09_models.ipynb')[:3]
    for n in sorted({r['config']['n'] for r in step['rows']}):
        got = [r['case'] for r in step['rows'] if r['config']['n'] == n and r['time_ratio'] is not None]
        assert got == list(POSITIONS), f"DecoderLM step table at n={n}: {got}"
    layer = ['sdpa_causal'] + [p for p in POSITIONS if p != 'absolute']   # 'absolute' is 'none' at the layer
    for t in (train, infer):
        assert [r['case'] for r in t['rows'] if r['time_ratio'] is not None] == layer, t['title']
    outs = [''.join(o['data']['text/markdown']) for c in _nb(HOME)['cells'] for o in c.get('outputs', [])
            if '| method | training step: time' in ''.join(o.get('data', {}).get('text/markdown', ''))]
    assert len(outs) == 1, 'the docs home shows no cost table (execute nbs/index.ipynb)'
    rows = [l.split('|')[1].strip() for l in outs[0].splitlines() if l.startswith('| `')]
    assert rows == [f'`{p}`' for p in POSITIONS]
    readme = (ROOT/'README.md').read_text()
    assert all(l in readme for l in outs[0].splitlines() if l.startswith('| `')), 'README.md: python tools/render_docs.py --readme'

def test_home_claims():
    "The docs home: the K/V cache's cost per token grows with the context (attention over n cached tokens is O(n d));"
    " no timings of one machine; 'seed' means random seeds only; what needs transformers is said where it is needed."
    cells = _nb(HOME)['cells']
    home = _markdown(_nb(HOME))
    assert 'does not grow' not in home
    assert not re.search(r'\b\d+ minutes\b', home), re.findall(r'[^.]*\b\d+ minutes\b[^.]*', home)
    methods = next(''.join(c['source']) for c in cells if ''.join(c['source']).startswith('## Methods'))
    assert not re.search(r'\bseeds?\b', methods), 'the code a chapter ports is its "original code", not its seed'
    install = next(''.join(c['source']) for c in cells if ''.join(c['source']).startswith('## Install'))
    assert 'pip install transformers' in install and '# the repository of' not in install
    torch_min = re.search(r'torch>=([\d.]+)', render_docs.read_settings()['requirements']).group(1)
    assert f'PyTorch ({torch_min} or later)' in install, f'settings.ini requires torch>={torch_min}'
    i = next(i for i, c in enumerate(cells) if c['cell_type'] == 'code' and 'from transformers' in ''.join(c['source']))
    assert 'pip install transformers' in ''.join(cells[i - 1]['source']), 'say before the cell that it needs transformers'

def test_train_command_lines_parse():
    "Every `relpos.train` command line shown in the training chapter and the guide is one the script accepts."
    from relpos.train import train_parser
    import shlex
    for name in ('13_train.ipynb', 'g2_distributed.ipynb'):
        lines = [l for block in re.findall(r'```sh\n(.*?)```', _markdown(_nb(ROOT/'nbs'/name)), re.S)
                 for l in block.replace('\\\n', ' ').splitlines() if 'relpos.train' in l]
        assert lines, f'{name}: no relpos.train command line'
        for l in lines:
            words = shlex.split(l)
            args = words[words.index('relpos.train') + 1:]
            try: train_parser().parse_args(args)
            except SystemExit: pytest.fail(f'{name}: {l!r} does not parse')

def test_sentences_from_the_cost_tables_are_current(monkeypatch):
    "A generated sentence or table that reads chapter 09's stored cost tables shows what they hold now: re-running its"
    " cell gives its stored output (a benchmark re-run without re-executing the chapters that quote it fails here)."
    from IPython.display import Markdown
    from relpos.bench import stored_tables, row
    from relpos.models import POSITIONS
    monkeypatch.chdir(ROOT/'nbs')
    checked = []
    for nb in NBS:
        for i, c in enumerate(_nb(nb)['cells']):
            src = ''.join(c['source'])
            if c['cell_type'] != 'code' or "stored_tables('09_models.ipynb')" not in src or not src.startswith('#| echo: false'): continue
            stored = [''.join(o['data']['text/markdown']) for o in c.get('outputs', []) if 'text/markdown' in o.get('data', {})]
            k = src.rindex('\nMarkdown(')   # the cell's last statement, at the top level, makes the output
            ns = dict(re=re, Markdown=Markdown, stored_tables=stored_tables, row=row, POSITIONS=POSITIONS)
            exec(src[:k], ns)
            got = eval(src[k + 1:], ns).data
            assert stored == [got], f'{nb.name} cell {i}: re-execute it (tools/execute_nb.py), its output is stale'
            checked.append(nb.name)
    assert {'index.ipynb', '06_rotary.ipynb', '07_alibi.ipynb', '08_t5.ipynb'} <= set(checked), checked

NEW_METHOD_BENCH = {'06b_xpos.ipynb': ['xpos'], '08d_fox.ipynb': ['fox'], '08c_kerple.ipynb': ['kerple log', 'kerple power']}

@pytest.mark.parametrize('name', sorted(NEW_METHOD_BENCH))
def test_cost_of_new_methods_stored_at_2048_beside_sdpa_and_rotary(name, monkeypatch):
    "The chapters of xPos, FoX and KERPLE store a training step at n = 2048 of causal SDPA, rotary and the method from one"
    " run, timed in CPU time on one thread (other jobs' time slices add nothing), each time also divided by rotary's; the"
    " sentence under the table, made from it, shows what it holds now."
    from IPython.display import Markdown
    from relpos.bench import stored_tables, row
    monkeypatch.chdir(ROOT/'nbs')
    table = stored_tables(name)[0]
    assert 'time = CPU time of the process' in table['note'] and 'cpu, 1 threads' in table['note'], table['note']
    for case in ['sdpa', 'rotary'] + NEW_METHOD_BENCH[name]:
        r = row(table, case, n=2048)
        assert r['time_ratio'] is not None and r['peak_ratio'] is not None and r.get('also_ratio') is not None, r
    cells = [c for c in _nb(ROOT/'nbs'/name)['cells'] if c['cell_type'] == 'code'
             and ''.join(c['source']).startswith('#| echo: false') and f"stored_tables('{name}')" in ''.join(c['source'])]
    assert cells, f'{name}: no sentence made from its benchmark table'
    for c in cells:
        src = ''.join(c['source'])
        stored = [''.join(o['data']['text/markdown']) for o in c.get('outputs', []) if 'text/markdown' in o.get('data', {})]
        k = src.rindex('\nMarkdown(')
        ns = dict(Markdown=Markdown, stored_tables=stored_tables, row=row)
        exec(src[:k], ns)
        got = eval(src[k + 1:], ns).data
        assert stored == [got], f'{name}: re-execute it (tools/execute_nb.py), its sentence is stale'
        assert '$n = 2048$' in got, got

def test_study_answer_current(monkeypatch):
    "The study's short answer, quoted on the docs home and in the guide to picking a method, is what the stored runs"
    " give now (`make study` re-executes both)."
    from relpos.bench import load_case
    monkeypatch.chdir(ROOT/'nbs')
    want = load_case('bench.study:StudyResults').load().which_to_use()
    call = "Markdown(load_case('bench.study:StudyResults').load().which_to_use())"
    for nb in (HOME, ROOT/'nbs'/'g3_which_method.ipynb'):
        [c] = [c for c in _nb(nb)['cells'] if call in ''.join(c['source'])]
        [got] = [''.join(o['data']['text/markdown']) for o in c['outputs'] if 'text/markdown' in o.get('data', {})]
        assert got == want, f'{nb.name}: its study answer is stale; execute it (tools/execute_nb.py)'

def test_lesson_t5_states_where_the_last_bucket_starts():
    "The T5 chapter's idea names the first distance of the decoder's last bucket; the bucket function agrees (113, not 128)."
    import torch
    from relpos.t5 import relative_position_bucket
    idea = next(''.join(c['source']) for c in _nb(ROOT/'nbs'/'08_t5.ipynb')['cells']
                if c['cell_type'] == 'markdown' and '## The idea' in ''.join(c['source']))
    m = re.search(r'every distance from (\d+) on shares the last one', idea)
    assert m, 'the idea no longer says where the last bucket starts'
    first = int(m.group(1))
    buckets = relative_position_bucket(-torch.arange(first - 1, first + 1), bidirectional=False)
    assert buckets.tolist() == [30, 31], f'distance {first - 1} is in bucket {buckets[0]}: the last bucket starts earlier'


# ----------------------------------------------------------------------------- what a learner's read of the chapters found
# Each test keeps one answered finding answered (../shared/reviews/learner-read-2026-11.md).

def test_mha_input_checks_documented_after_the_lesson():
    "Chapter 01's input checks stay exported and tested, but their API entries come under *Bad inputs*, after the lesson,"
    " not between the interface and the module."
    cells = _nb(ROOT/'nbs'/'01_mha.ipynb')['cells']
    fast = next(i for i, c in enumerate(cells) if FAST_HEADING in _h2(c))
    checks = ('check_sequence', 'size_or_one', 'check_inputs', 'prepare_mask', 'check_position_ids', 'check_position_order')
    for i, c in enumerate(cells[:fast]):
        s = ''.join(c['source'])
        if c['cell_type'] != 'code' or not re.match(r'#\|\s*exports?\b', s): continue
        for name in checks:
            if re.search(rf'^def {name}\b', s, re.M): assert '#| hide' in s, f'cell {i}: {name} gets its API entry in the lesson'
    later = [''.join(c['source']) for c in cells[fast:]]
    for name in checks: assert any(re.match(rf'show_doc\((MultiHeadAttention\.)?{name}\)', s) for s in later), name

def test_study_chapter_notation_and_yarn():
    "Chapter 11 writes the evaluation length n (L is FIRE's threshold only) and the rotary frequency theta_f, and says that"
    " YaRN's attention factor sharpens the softmax: it multiplies cos and sin, so the scores by its square."
    md = _markdown(_nb(ROOT/'nbs'/'11_which_method.ipynb'))
    assert '\\theta_d' not in md and 'tempers the softmax' not in md and 'a sharper softmax' in md
    for p in _paragraphs(md):
        if re.search(r'\$[^$]*\bL\b[^$]*\$', p): assert 'FIRE' in p or '`fire' in p, f'$L$ outside FIRE: {p[:120]}'

def test_fire_chapter_points_to_the_study_and_the_gpu():
    "FIRE's chapter says where its extrapolation is put to the test (the study, both thresholds) and what it costs on a GPU."
    nb = _nb(ROOT/'nbs'/'08b_fire.ipynb')
    md = _markdown(nb)
    assert '](11_which_method.ipynb)' in md and '`fire+L512`' in md
    gpu = [''.join(o['data']['text/markdown']) for c in nb['cells'] if "stored_cuda('layers')" in ''.join(c['source'])
           for o in c.get('outputs', []) if 'text/markdown' in o.get('data', {})]
    assert len(gpu) == 1 and '](g1_gpu.ipynb)' in gpu[0] and 'SDPA' in gpu[0]

def test_hf_chapter_says_which_positions_swap_and_why():
    "Chapter 12 names the position methods a converted model can swap to, and why the others are refused; it repeats"
    " rotary's caveat about `dynamic` and points to the guides with a tokenizer and a GPU."
    from relpos.hf import SWAP_POSITIONS
    from relpos.models import POSITIONS, BIAS_POSITIONS
    md = _markdown(_nb(ROOT/'nbs'/'12_hf.ipynb'))
    swap = next((p for p in _paragraphs(md) if '`SWAP_POSITIONS`' in p), '')
    refused = [p for p in POSITIONS if p not in BIAS_POSITIONS and p not in SWAP_POSITIONS and p != 'absolute']
    assert refused and all(f'`{p}`' in swap for p in refused), (refused, swap)
    assert '](g0_generate.ipynb)' in md and '](g1_gpu.ipynb)' in md and 'With `dynamic` rope scaling' in md

def test_home_study_summary_states_no_run_counts():
    "The docs home describes the study as the study chapter does, and leaves counts of its runs to that chapter."
    md = _markdown(_nb(HOME))
    assert not re.search(r'\b\d+ runs\b', md) and 'for the best methods' not in md

def test_dynamic_rope_caveat_is_what_transformers_does():
    "Chapters 06 and 12 say when a converted `dynamic` LLaMA and transformers' differ: on a call longer than"
    " `max_position_embeddings` and shorter than one transformers' model saw since a shorter call reset its buffer."
    torch = pytest.importorskip('torch'); transformers = pytest.importorskip('transformers')
    from relpos.models import DecoderLM
    import relpos.hf
    for name in ('06_rotary.ipynb', '12_hf.ipynb'):
        assert 'resets it' in _markdown(_nb(ROOT/'nbs'/name)), f'{name}: the caveat about `dynamic` does not say when transformers resets'
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   max_position_embeddings=16, rope_parameters={'rope_type': 'dynamic', 'factor': 2.0, 'rope_theta': 10000.0})
    llama = transformers.LlamaForCausalLM(cfg).double().eval()
    lm = DecoderLM.from_transformers(llama)
    differs = []
    for n in (8, 32, 24, 8, 20):   # fresh, growth, shorter than the grown length, reset, growth again
        t = torch.randint(0, 64, (1, n))
        with torch.no_grad(): differs.append(bool((lm(t)[0] - llama(t).logits).abs().max() > 1e-6))
    assert differs == [False, False, True, False, False], differs
