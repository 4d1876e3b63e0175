#!/usr/bin/env python
"""Offline docs renderer for relpos: the `make docs` fallback when Quarto is not on PATH.

    .venv/bin/python tools/render_docs.py              # build the site into _docs/ (processed notebooks in _proc/)
    .venv/bin/python tools/render_docs.py --out DIR    # build elsewhere (tests build into a temp dir)
    .venv/bin/python tools/render_docs.py --readme     # write README.md from nbs/index.ipynb (deterministic)
    .venv/bin/python tools/render_docs.py --readme -   # ... to stdout (for a sync check)
    .venv/bin/python tools/render_docs.py --sidebar    # write nbs/sidebar.yml (index, then the chapters in name order)

Pipeline, per notebook `nbs/*.ipynb` (names starting with `_` or `.` skipped):
1. nbdev's own doc processors (`nbdev.processors.FilterDefaults`, what `nbdev_proc_nbs` runs): front matter
   from the `# Title` / `> description` cell, `#| hide`, show_doc cells added and executed (with the import cells),
   exported source moved after its docs, doc links. One spawned process per notebook, in parallel; the processed
   notebook is written to `_proc/` (or `--proc`). If processing fails, the page is rendered from the same
   processors minus the execution step, and the command exits 1 after writing every page.
2. nbconvert's `basic` HTML template renders cells and stored outputs (plots stay base64 `<img>`, text/markdown
   outputs become tables). Cell options (`#| ...`) are stripped from the shown code and honoured
   (`echo: false`, `output: false`, `include: false`); Quarto syntax (`:::` divs, callouts, `{.class}` attributes,
   shortcodes) is degraded to plain HTML.
3. Pages get the front matter as `<h1>` + description, a sidebar linking every page in `nbs/sidebar.yml` order,
   `X.ipynb` links (and nbdev's doc-site links) rewritten to local `.html` pages, and MathJax 2.7 copied from
   `jupyter_server_mathjax` into `<out>/mathjax/` (no CDN; `$..$` and `$$..$$`).
Pages are named after the notebook (`00_shift.ipynb` -> `00_shift.html`; Quarto would write `shift.html`).
"""
import argparse, html, json, os, re, shutil, sys, tempfile, time, warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = 'relpos tools/render_docs.py (nbdev processors + nbconvert, offline)'

# ---------------------------------------------------------------------------------------------- config, listing

def read_settings(root=ROOT):
    import configparser
    cp = configparser.ConfigParser()
    cp.read(root/'settings.ini')
    return dict(cp['DEFAULT']) if cp.has_section('DEFAULT') or cp.defaults() else {}

def list_notebooks(nbs):
    "Notebooks to render: `nbs/*.ipynb`, skipping `_*`/`.*` names, `index.ipynb` first, then by name."
    nbs = sorted(p for p in Path(nbs).glob('*.ipynb') if not p.name.startswith(('_', '.')))
    return sorted(nbs, key=lambda p: (p.name != 'index.ipynb', p.name))

def sidebar_order(nbs, names):
    "`names` (notebook file names) ordered as in `nbs/sidebar.yml` when it exists; the rest after, by name."
    order = []
    sb = Path(nbs)/'sidebar.yml'
    if sb.exists():
        try:
            import yaml
            def walk(o):
                if isinstance(o, str): order.append(Path(o).name)
                elif isinstance(o, list):
                    for x in o: walk(x)
                elif isinstance(o, dict):
                    for k in ('href', 'file'):
                        if isinstance(o.get(k), str): order.append(Path(o[k]).name)
                    walk(o.get('contents', []))
            walk(((yaml.safe_load(sb.read_text()) or {}).get('website') or {}).get('sidebar', {}).get('contents', []))
        except Exception as e: print(f'render_docs: ignoring unreadable {sb}: {e}', file=sys.stderr)
    known = [n for n in order if n in names]
    rest = sorted((n for n in names if n not in known), key=lambda n: (n != 'index.ipynb', n))
    return list(dict.fromkeys(known + rest))

def write_sidebar(nbs):
    "Write `nbs/sidebar.yml` (nbdev's custom sidebar format): index, then every chapter by name."
    names = [p.name for p in list_notebooks(nbs)]
    text = 'website:\n  sidebar:\n    contents:\n' + ''.join(f'      - {n}\n' for n in names)
    (Path(nbs)/'sidebar.yml').write_text(text)
    return Path(nbs)/'sidebar.yml'

# ---------------------------------------------------------------------------------------------- step 1: nbdev

def _read_nb(path, tries=5):
    "Read a notebook; retry briefly, since other people may be saving it right now."
    from execnb.nbio import read_nb
    for i in range(tries):
        try: return read_nb(path)
        except (json.JSONDecodeError, ValueError):
            if i == tries - 1: raise
            time.sleep(0.5)

def _nbdev_process(path, execute=True):
    "Run nbdev's doc processors on one notebook (optionally without executing show_doc/import cells)."
    from nbdev.processors import FilterDefaults, exec_show_docs
    class NoExec(FilterDefaults):
        def base_procs(self): return [p for p in super().base_procs() if p is not exec_show_docs]
    nb = _read_nb(path)
    (FilterDefaults if execute else NoExec)()(nb)
    return nb

def _strip_nb(o):
    "execnb's notebook (AttrDicts with extra attributes) -> plain JSON-able dict."
    return json.loads(json.dumps(o, default=lambda x: None))

def process_one(args):
    "Worker (spawned process): process one notebook with nbdev, save it to `proc`, render its HTML body."
    path, proc, root = args
    os.chdir(root)   # nbdev_proc_nbs runs from the repo root
    os.environ['IN_TEST'] = '1'; os.environ.setdefault('MPLBACKEND', 'Agg')
    if str(root) not in sys.path: sys.path.insert(0, str(root))
    res = dict(name=Path(path).name, error=None, warnings=[])
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter('always')
        try: nb = _nbdev_process(path)
        except Exception as e:
            cause = e.__cause__ or e
            res['error'] = f'{type(e).__name__}: {e}'.strip() + (f'\n    caused by {type(cause).__name__}: {cause}' if cause is not e else '')
            nb = _nbdev_process(path, execute=False)
    res['warnings'] = sorted({str(w.message).splitlines()[0] for w in ws if 'nbdev' in str(w.filename) or 'FAQ' in str(w.message)})
    nb = _strip_nb(nb)
    if proc:
        Path(proc).mkdir(parents=True, exist_ok=True)
        (Path(proc)/Path(path).name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + '\n')
    fm, nb = split_frontmatter(nb)
    res.update(frontmatter=fm, nb=nb, body=render_body(nb))
    return res

# ---------------------------------------------------------------------------------------------- front matter

def split_frontmatter(nb):
    "Take the `---` YAML raw cell nbdev's FrontmatterProc writes (or a leading `# Title` cell) out of `nb`."
    import yaml
    fm, cells = {}, []
    for c in nb['cells']:
        src = ''.join(c.get('source', ''))
        if not fm and c['cell_type'] == 'raw' and src.strip().startswith('---'):
            try: fm = yaml.safe_load(src.strip().strip('-')) or {}
            except Exception: fm = {}
            continue
        if c['cell_type'] == 'markdown' and src.strip().startswith('<!-- WARNING: THIS FILE WAS AUTOGENERATED'): continue
        cells.append(c)
    if not fm.get('title'):   # unprocessed notebook: `# Title` / `> description` in the first markdown cell
        for i, c in enumerate(cells):
            if c['cell_type'] != 'markdown': continue
            m = re.match(r'\s*#\s+(.+?)\s*\n(?:\s*\n)*(?:>\s*(.+?)\s*(?:\n|$))?', ''.join(c['source']) + '\n')
            if m:
                fm = {**fm, 'title': m.group(1), **({'description': m.group(2)} if m.group(2) else {})}
                rest = ''.join(c['source'])[m.end():]
                if rest.strip(): cells[i] = {**c, 'source': rest}
                else: del cells[i]
            break
    return fm, {**nb, 'cells': cells}

# ---------------------------------------------------------------------------------------------- cell options

_re_directive = re.compile(r'^\s*#\s*\|\s*([\w-]+)\s*:?\s*(.*?)\s*$')

def split_directives(src):
    "Leading `#| key: value` lines of a code cell -> ({key: value}, remaining source)."
    lines, d = src.splitlines(), {}
    while lines:
        m = _re_directive.match(lines[0])
        if not m: break
        d[m.group(1).lower()] = m.group(2).strip().strip('"\'')
        lines.pop(0)
    return d, '\n'.join(lines)

def _false(v): return str(v).strip().lower() in ('false', 'no', '0')

def apply_directives(nb):
    "Honour Quarto/nbdev cell options in code cells and strip them from the shown source."
    cells = []
    for c in nb['cells']:
        if c['cell_type'] != 'code': cells.append(c); continue
        d, src = split_directives(''.join(c.get('source', '')))
        if 'hide' in d or _false(d.get('include', 'true')): continue
        c = {**c, 'source': src, 'metadata': dict(c.get('metadata', {}))}
        if _false(d.get('echo', 'true')) or not src.strip(): c['metadata']['transient'] = {'remove_source': True}
        if _false(d.get('output', 'true')) or 'hide_output' in d: c['outputs'] = []
        if not src.strip() and not c.get('outputs'): continue
        cells.append(c)
    return {**nb, 'cells': cells}

# ---------------------------------------------------------------------------------------------- Quarto markdown

_re_fence = re.compile(r'^\s*(```|~~~)')
_re_div = re.compile(r'^\s*:::+\s*(\{[^}]*\}|[\w.-]+)?\s*$')
_re_heading_attr = re.compile(r'^(#{1,6}\s.*?)\s*\{[^}]*\}\s*$')
_re_span_attr = re.compile(r'\[([^\]\n]+)\]\{(?=[.#]|[\w-]+=)[^}\n]*\}')
_re_img_attr = re.compile(r'(!\[[^\]\n]*\]\([^)\n]*\))\{[^}\n]*\}')
_re_link_attr = re.compile(r'(?<!!)\[([^\]\n]*)\]\(([^)\s]*)\)\{([^}\n]*)\}')
_re_shortcode = re.compile(r'\{\{<.*?>\}\}')
# nbdev links every backticked name it knows, the argument comments of show_doc's signature included; that signature
# is a code block, where a link cannot render and `[`name`](url)` would show as it is: keep the code span, drop the link
_re_code_link = re.compile(r'\[(`[^`\n]+`)\]\([^)\s]+\)')

def _link_attr(m):
    "`[text](url){target=\"_blank\" .cls key=\"v\"}` (nbdev's show_doc `source` link) -> an `<a>` with those attributes."
    text, url, attrs = m.groups()
    kv = dict(re.findall(r'([\w-]+)\s*=\s*"([^"]*)"', attrs))
    classes = re.findall(r'(?:^|\s)\.([\w-]+)', attrs)
    if classes: kv['class'] = ' '.join(classes)
    extra = ''.join(f' {k}="{html.escape(v)}"' for k, v in kv.items() if k != 'href')
    return f'<a href="{html.escape(url)}"{extra}>{text}</a>'

def _div_open(attrs):
    classes = re.findall(r'(?:^|[\s{])\.([\w-]+)', attrs or '')
    if not classes and attrs and not attrs.startswith('{'): classes = [attrs]
    title = re.search(r'title\s*=\s*"([^"]*)"', attrs or '')
    cls = ' '.join(['quarto-div'] + [f'callout {c}' if c.startswith('callout') else c for c in classes])
    out = f'<div class="{html.escape(cls)}">'
    if any(c.startswith('callout') for c in classes):
        kind = next(c for c in classes if c.startswith('callout')).replace('callout-', '') or 'note'
        out += f'<div class="callout-title">{html.escape(title.group(1) if title else kind.capitalize())}</div>'
    return out

def degrade_quarto(md):
    "Quarto-only markdown -> plain markdown + HTML: `:::` divs (callouts) balanced inside the text become `<div>`s,"
    " unbalanced ones are dropped; `{...}` attributes and `{{< >}}` shortcodes are removed. In code fences only nbdev's"
    " links around code spans are undone (a code block shows no link)."
    lines, out, fence, stack = md.split('\n'), [], None, []
    opens = {}
    for i, l in enumerate(lines):   # pair the ::: markers first, so unbalanced ones can be dropped
        if fence:
            if l.strip().startswith(fence): fence = None
            continue
        m = _re_fence.match(l)
        if m: fence = m.group(1); continue
        m = _re_div.match(l)
        if not m: continue
        if m.group(1): stack.append(i)
        elif stack: opens[stack.pop()] = i
    pairs = {**{o: 'open' for o in opens}, **{c: 'close' for c in opens.values()}}
    fence = None
    for i, l in enumerate(lines):
        if fence:
            if l.strip().startswith(fence): fence = None
            out.append(_re_code_link.sub(r'\1', l)); continue
        m = _re_fence.match(l)
        if m: fence = m.group(1); out.append(l); continue
        m = _re_div.match(l)
        if m:
            if pairs.get(i) == 'open': out += [_div_open(m.group(1)), '']
            elif pairs.get(i) == 'close': out += ['', '</div>', '']
            continue
        l = _re_heading_attr.sub(r'\1', l)
        l = _re_img_attr.sub(r'\1', l)
        l = _re_link_attr.sub(_link_attr, l)
        l = _re_span_attr.sub(r'\1', l)
        l = _re_shortcode.sub('', l)
        out.append(l)
    return '\n'.join(out)

def degrade_nb(nb):
    cells = []
    for c in nb['cells']:
        c = dict(c)
        if c['cell_type'] == 'markdown':
            c['source'] = degrade_quarto(''.join(c.get('source', '')))
            if not c['source'].strip(): continue
        for o in c.get('outputs', []):
            md = o.get('data', {}).get('text/markdown')
            if md is not None: o['data']['text/markdown'] = degrade_quarto(''.join(md))
        cells.append(c)
    return {**nb, 'cells': cells}

# ---------------------------------------------------------------------------------------------- step 2: nbconvert

def render_body(nb):
    "HTML of the cells (no page chrome) with nbconvert's `basic` template; stored outputs kept as they are."
    import nbformat
    from nbconvert import HTMLExporter
    nb = degrade_nb(apply_directives(nb))
    node = nbformat.from_dict(nb)
    nbformat.v4.rwbase.rejoin_lines(node)   # stored outputs keep their text as a list of lines, as in the .ipynb
    node.setdefault('metadata', {})
    for c in node.cells: c.pop('id', None)
    node.nbformat_minor = 4
    exp = HTMLExporter(template_name='basic', exclude_input_prompt=True, exclude_output_prompt=True,
                       anchor_link_text='¶')
    body, _ = exp.from_notebook_node(node)
    return body

def inline_md(text):
    "Markdown of a title/description line -> inline HTML (code spans, emphasis, links)."
    from nbconvert.filters.markdown_mistune import markdown2html_mistune
    h = markdown2html_mistune(text or '').strip()
    return re.sub(r'^<p>(.*)</p>$', r'\1', h, flags=re.S)

def plain(text):
    return re.sub(r'[`*_]', '', text or '')

# ---------------------------------------------------------------------------------------------- step 3: pages

def rewrite_links(body, pages, doc_url, outfile_map):
    "`X.ipynb[#a]` -> `X.html[#a]`; nbdev doc-site links (`{doc_host}{doc_baseurl}/shift.html#x`) -> local page."
    def ipynb(m):
        stem = m.group(2)
        return f'{m.group(1)}{stem}.html{m.group(3) or ""}"'
    body = re.sub(r'(href=")(?:\./)?(?:nbs/)?([^"#:/?]+)\.ipynb(#[^"]*)?"', ipynb, body)
    if doc_url:
        def site(m):
            page = outfile_map.get(m.group(1))
            return f'href="{page}{m.group(2) or ""}"' if page else m.group(0)
        body = re.sub(r'href="' + re.escape(doc_url.rstrip('/')) + r'/([^"#/?]+\.html)(#[^"]*)?"', site, body)
    return body

# ---------------------------------------------------------------------------------------------- ids, links, contents

def pandoc_id(text):
    "Pandoc's (and so Quarto's) automatic identifier of a heading: lowercase, punctuation other than `_-.` removed,"
    " spaces to `-`, everything before the first letter dropped. nbdev's doc links (`#multiheadattention.forward`) use it."
    t = re.sub(r'[^\w\s.-]', '', html.unescape(re.sub(r'<[^>]+>', '', text)).strip().lower())
    t = re.sub(r'^[^a-z]+', '', re.sub(r'\s+', '-', t))
    return t or 'section'

_re_heading = re.compile(r'<h([1-6])(\s[^>]*)?\bid="([^"]*)"([^>]*)>(.*?)</h\1>', re.S)

def fix_heading_ids(body):
    "Give every heading its Pandoc id (unique on the page: `-1`, `-2` ... as Pandoc does); returns (body, {old id: new},"
    " [(level, id, heading html)]). nbconvert keeps the heading's case and punctuation (`id=\"MultiHeadAttention\"`)."
    used, old2new, heads = {}, {}, []
    def sub(m):
        level, pre, old, post, inner = m.groups()
        text = re.sub(r'<a class="anchor-link"[^>]*>.*?</a>', '', inner, flags=re.S)
        new = base = pandoc_id(text)
        if base in used:
            used[base] += 1; new = f'{base}-{used[base]}'
        used.setdefault(new, 0)
        old2new.setdefault(old, new)
        heads.append((int(level), new, text.strip()))
        inner = inner.replace(f'href="#{old}"', f'href="#{new}"')
        return f'<h{level}{pre or ""} id="{new}"{post}>{inner}</h{level}>'
    return _re_heading.sub(sub, body), old2new, heads

def page_ids(body):
    "Every `id=\"...\"` on a page."
    return set(re.findall(r'\bid="([^"]+)"', body))

def resolve_links(body, page, ids, old2new):
    "Point `#frag` and `page.html#frag` links of the site at ids that exist: a fragment that is not an id of its page"
    " is looked up among the page's renamed headings, then by Pandoc id, then case-insensitively."
    def target(pg, frag):
        have = ids.get(pg)
        if have is None or frag in have: return frag
        for cand in (old2new.get(pg, {}).get(frag), pandoc_id(frag.replace('-', ' '))):
            if cand in have: return cand
        low = {i.lower(): i for i in have}
        return low.get(frag.lower(), frag)
    def unlink_private(m):
        # nbdev links every exported name in backticks, `_private` helpers too, but only public names get a
        # show_doc anchor: such a link would open the page at its top, so the name stays plain code
        pg, frag = m.group(1), m.group(2)
        have = ids.get(pg or page)
        return m.group(3) if have is not None and target(pg or page, frag) not in have else m.group(0)
    body = re.sub(r'<a href="((?:[^"#:/?]+\.html)?)#(_[^"]*)"[^>]*>(<code>[^<]*</code>)</a>', unlink_private, body)
    def sub(m):
        pg, frag = m.group(1), m.group(2)
        return f'href="{pg}#{target(pg or page, frag)}"'
    return re.sub(r'href="((?:[^"#:/?]+\.html)?)#([^"]*)"', sub, body)

def toc_html(heads, min_headings=4):
    "An 'On this page' list of the h2 and h3 headings (empty for short pages)."
    heads = [(l, i, t) for l, i, t in heads if l in (2, 3)]
    if len(heads) < min_headings: return ''
    items = ''.join(f'<li class="toc-h{l}"><a href="#{i}">{t}</a></li>' for l, i, t in heads)
    return f'<nav class="toc" aria-label="On this page"><details open><summary>On this page</summary><ul>{items}</ul></details></nav>'

ACTIVE = ' class="active"'

MATHJAX_CONFIG = r"""<script type="text/x-mathjax-config">
MathJax.Hub.Config({
  tex2jax: {inlineMath: [['$','$'], ['\\(','\\)']], displayMath: [['$$','$$'], ['\\[','\\]']],
            processEscapes: true, processEnvironments: true, skipTags: ["script","noscript","style","textarea","pre","code"]},
  "HTML-CSS": {availableFonts: [], preferredFont: null, webFont: "STIX-Web", imageFont: null, linebreaks: {automatic: true}},
  showMathMenu: false, messageStyle: "none"
});
</script>
<script type="text/javascript" src="mathjax/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full"></script>"""

PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="generator" content="{generator}">
<title>{title_text}</title>
<link rel="stylesheet" href="site.css">
{mathjax}
</head>
<body>
<nav class="sidebar">
<a class="brand" href="index.html">{site_title}</a>
<ul>
{nav}
</ul>
<p class="renderer">Rendered offline from the notebooks (nbdev processors + nbconvert; Quarto not found).</p>
</nav>
<main>
<header class="page-header">
<h1 class="title">{title}</h1>
{description}
</header>
{toc}
{body}
<footer>{pager}</footer>
</main>
</body>
</html>
"""

CSS = """
:root { --fg: #212529; --muted: #6c757d; --accent: #2f6fb0; --code-bg: #f6f8fa; --border: #dee2e6; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); font: 16px/1.6 -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, "DejaVu Sans", sans-serif; }
a { color: var(--accent); text-decoration: none; } a:hover { text-decoration: underline; }
nav.sidebar { position: fixed; top: 0; left: 0; bottom: 0; width: 250px; overflow-y: auto; padding: 1.2rem 1rem;
  background: #f8f9fa; border-right: 1px solid var(--border); font-size: 0.92rem; }
nav.sidebar .brand { display: block; font-size: 1.35rem; font-weight: 600; color: var(--fg); margin-bottom: 0.8rem; }
nav.sidebar ul { list-style: none; margin: 0; padding: 0; }
nav.sidebar li a { display: block; padding: 0.3rem 0.5rem; border-radius: 4px; color: var(--fg); }
nav.sidebar li a:hover { background: #e9ecef; text-decoration: none; }
nav.sidebar li.active a { background: var(--accent); color: #fff; }
nav.sidebar li.active code { background: none; color: #fff; }
nav.sidebar .renderer { margin-top: 1.5rem; font-size: 0.75rem; color: var(--muted); }
main { margin-left: 250px; max-width: 1000px; padding: 1.5rem 2.5rem 4rem; }
@media (max-width: 800px) { nav.sidebar { position: static; width: auto; border-right: 0; border-bottom: 1px solid var(--border); }
  main { margin-left: 0; padding: 1rem; } }
.page-header { border-bottom: 1px solid var(--border); margin-bottom: 1.5rem; padding-bottom: 0.8rem; }
h1.title { margin: 0.2rem 0 0.4rem; font-size: 2.1rem; line-height: 1.25; }
.description { margin: 0; font-size: 1.15rem; font-style: italic; color: var(--muted); }
h1, h2, h3, h4 { line-height: 1.3; } h2 { margin-top: 2rem; border-bottom: 1px solid #eee; padding-bottom: 0.2rem; }
a.anchor-link { visibility: hidden; margin-left: 0.3em; font-size: 0.8em; color: var(--muted); }
h1:hover a.anchor-link, h2:hover a.anchor-link, h3:hover a.anchor-link, h4:hover a.anchor-link { visibility: visible; }
pre, code { font-family: "SFMono-Regular", Menlo, Consolas, "DejaVu Sans Mono", monospace; font-size: 0.86em; }
:not(pre) > code { background: var(--code-bg); padding: 0.1em 0.3em; border-radius: 3px; }
pre { background: var(--code-bg); padding: 0.7rem 0.9rem; border-radius: 5px; overflow-x: auto; line-height: 1.45; margin: 0; }
.jp-Cell { margin: 0 0 1rem; }
.jp-CodeCell .jp-InputArea .highlight { border-left: 3px solid var(--accent); border-radius: 5px; }
.jp-OutputArea-output { margin: 0.3rem 0 0 0.8rem; overflow-x: auto; }
.jp-OutputArea-output pre, .jp-RenderedText pre { background: none; border-left: 2px solid lightsalmon; border-radius: 0; }
.jp-RenderedHTMLCommon pre.highlight, .jp-RenderedMarkdown pre { border-left: 0; }
.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"] pre { background: #fff5f5; }
.jp-InputPrompt, .jp-OutputPrompt, .jp-Collapser { display: none; }
img, svg, video { max-width: 100%; height: auto; }
table { border-collapse: collapse; margin: 0.8rem 0; display: block; overflow-x: auto; font-size: 0.92rem; }
th, td { border: 1px solid var(--border); padding: 0.35rem 0.65rem; text-align: left; vertical-align: top; }
thead th { background: #f1f3f5; } tbody tr:nth-child(even) { background: #fafbfc; }
blockquote { margin: 0.8rem 0; padding: 0.1rem 1rem; border-left: 4px solid var(--border); color: #495057; }
hr { border: 0; border-top: 1px solid var(--border); margin: 1.5rem 0; }
.callout { border: 1px solid var(--border); border-left: 5px solid var(--accent); border-radius: 5px; padding: 0.2rem 1rem; margin: 1rem 0; }
.callout-title { font-weight: 600; margin: 0.4rem 0 0; }
.callout-warning, .callout-caution { border-left-color: #e0a800; } .callout-important { border-left-color: #d9534f; }
.callout-tip { border-left-color: #28a745; }
mjx-container, .MathJax_SVG_Display { overflow-x: auto; overflow-y: hidden; }
nav.toc { font-size: 0.88rem; margin: 0 0 1.5rem; padding: 0.4rem 0.9rem; border: 1px solid var(--border); border-radius: 5px; background: #fbfcfd; }
nav.toc summary { font-weight: 600; cursor: pointer; }
nav.toc ul { list-style: none; margin: 0.3rem 0 0.2rem; padding: 0; columns: 2; column-gap: 2rem; }
nav.toc li { break-inside: avoid; padding: 0.05rem 0; } nav.toc li.toc-h3 { padding-left: 1.1rem; }
@media (min-width: 1560px) { nav.toc { position: fixed; top: 1.2rem; left: calc(250px + 1000px + 1rem); width: 270px;
  max-height: calc(100vh - 2.4rem); overflow-y: auto; margin: 0; } nav.toc ul { columns: 1; } }
/* code wraps instead of running off the page (Quarto's code-overflow: wrap); printed output keeps its lines and scrolls */
.highlight pre { white-space: pre-wrap; overflow-wrap: anywhere; }
footer { margin-top: 3rem; padding-top: 1rem; border-top: 1px solid var(--border); display: flex; justify-content: space-between; font-size: 0.9rem; }
"""

def copy_mathjax(out):
    "Copy MathJax 2.7 shipped in `jupyter_server_mathjax` to `out/mathjax/` (docs must render offline)."
    import jupyter_server_mathjax
    src = Path(jupyter_server_mathjax.__file__).parent/'static'
    if not (src/'MathJax.js').exists(): raise FileNotFoundError(f'MathJax.js not found in {src}')
    skip = shutil.ignore_patterns('*.md', 'unpacked', 'test', 'docs')
    shutil.copytree(src, Path(out)/'mathjax', ignore=skip, dirs_exist_ok=True)

def run_workers(jobs, n_workers, timeout):
    "One fresh process per notebook (as nbdev; executed cells leave state and take over `__main__`), at most"
    " `n_workers` at a time. A notebook whose processing outlives `timeout` seconds (a cell with an import that"
    " also runs a benchmark is executed by nbdev too) is killed and rendered without the execution step;"
    " `timeout` 0 or None: no limit (the tests: how long a notebook takes depends on the machine's load)."
    import subprocess
    pending, running, results, tmpd = list(jobs), {}, {}, Path(tempfile.mkdtemp(prefix='render_docs_'))
    try:
        while pending or running:
            while pending and len(running) < n_workers:
                job = pending.pop(0); res = tmpd/(Path(job[0]).stem + '.json')
                cmd = [sys.executable, str(Path(__file__).resolve()), '--_worker', job[0], job[1] or '', str(res)]
                running[job[0]] = (subprocess.Popen(cmd, cwd=job[2], stdout=subprocess.DEVNULL), time.time(), res, job)
            for k, (p, t0, res, job) in list(running.items()):
                if p.poll() is None and (not timeout or time.time() - t0 < timeout): continue
                if p.poll() is None:
                    p.kill(); p.wait()
                    err = f'timed out after {timeout:.0f}s (a cell nbdev executes for the docs runs too long)'
                elif p.returncode == 0 and res.exists(): err = None
                else: err = f'worker exited with {p.returncode}'
                if err:
                    r = _fallback(job, err)
                else: r = json.loads(res.read_text())
                results[k] = r; del running[k]
            time.sleep(0.05)
    finally: shutil.rmtree(tmpd, ignore_errors=True)
    return [results[j[0]] for j in jobs]

def _fallback(job, err):
    path, proc, root = job
    nb = _strip_nb(_nbdev_process(path, execute=False))
    fm, nb2 = split_frontmatter(nb)
    return dict(name=Path(path).name, error=err, warnings=[], frontmatter=fm, nb=nb2, body=render_body(nb2))

def build_site(out, proc=None, nbs=None, n_workers=None, quiet=False, timeout=180):
    "Build the whole site into `out`; returns (results, failed names)."
    nbs = Path(nbs or ROOT/'nbs')
    settings = read_settings()
    site_title = settings.get('title') or settings.get('lib_name') or 'docs'
    doc_url = (settings.get('doc_host', '') + settings.get('doc_baseurl', '')).rstrip('/')
    paths = list_notebooks(nbs)
    t0 = time.time()
    n_workers = n_workers or max(1, min(len(paths), os.cpu_count() or 1, 8))
    jobs = [(str(p), str(proc) if proc else None, str(ROOT)) for p in paths]
    results = run_workers(jobs, n_workers, timeout)
    by_name = {r['name']: r for r in results}
    order = sidebar_order(nbs, list(by_name))

    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix='.' + out.name + '.', dir=out.parent))   # build aside, then swap in
    try:
        copy_mathjax(tmp)
        from pygments.formatters import HtmlFormatter
        (tmp/'site.css').write_text(CSS.lstrip() + HtmlFormatter(style='default').get_style_defs('.highlight') + '\n')
        (tmp/'.nojekyll').write_text('')
        page_of = {n: Path(n).stem + '.html' for n in order}
        outfile_map = {}
        for n in order:
            of = by_name[n]['frontmatter'].get('output-file') or Path(n).stem + '.html'
            outfile_map[Path(of).name] = page_of[n]
        titles = {n: by_name[n]['frontmatter'].get('title') or Path(n).stem for n in order}
        if 'index.ipynb' not in by_name: titles['index.ipynb'] = site_title
        nav_names = (['index.ipynb'] if 'index.ipynb' not in by_name else []) + order
        bodies, heads, old2new, ids = {}, {}, {}, {}
        for n in order:   # first pass: Pandoc ids on every page, so that links between pages can be resolved
            body = rewrite_links(by_name[n]['body'], page_of, doc_url, outfile_map)
            bodies[n], old2new[page_of[n]], heads[n] = fix_heading_ids(body)
            ids[page_of[n]] = page_ids(bodies[n])
        for i, n in enumerate(order):
            r = by_name[n]; fm = r['frontmatter']
            nav = '\n'.join(f'<li{ACTIVE if m == n else ""}><a href="{Path(m).stem}.html">'
                            f'{inline_md(titles[m])}</a></li>' for m in nav_names)
            prev_ = f'<a href="{page_of[order[i-1]]}">← {inline_md(titles[order[i-1]])}</a>' if i else '<span></span>'
            next_ = f'<a href="{page_of[order[i+1]]}">{inline_md(titles[order[i+1]])} →</a>' if i + 1 < len(order) else '<span></span>'
            desc = fm.get('description')
            body = resolve_links(bodies[n], page_of[n], ids, old2new)
            page = PAGE.format(generator=html.escape(GENERATOR), title_text=html.escape(plain(titles[n]) + (f' – {site_title}' if n != 'index.ipynb' else '')),
                               mathjax=MATHJAX_CONFIG, site_title=html.escape(site_title), nav=nav,
                               title=inline_md(titles[n]), description=f'<p class="description">{inline_md(desc)}</p>' if desc else '',
                               toc=toc_html(heads[n]), body=body, pager=prev_ + next_)
            (tmp/page_of[n]).write_text(page)
            copy_assets(body, nbs, tmp)
        if 'index.ipynb' not in by_name:   # no home notebook yet: a plain list of the chapters
            items = '\n'.join(f'<li><a href="{page_of[n]}">{inline_md(titles[n])}</a></li>' for n in order)
            nav = '\n'.join(f'<li><a href="{Path(m).stem}.html">{inline_md(titles[m])}</a></li>' for m in nav_names)
            (tmp/'index.html').write_text(PAGE.format(generator=html.escape(GENERATOR), title_text=html.escape(site_title),
                mathjax='', site_title=html.escape(site_title), nav=nav, title=html.escape(site_title),
                description=f'<p class="description">{html.escape(settings.get("description", ""))}</p>', toc='',
                body=f'<ul>{items}</ul>', pager=''))
        if out.exists(): shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists(): shutil.rmtree(tmp, ignore_errors=True)
    failed = [r['name'] for r in results if r['error']]
    for r in results:
        for w in r['warnings']:
            if not quiet: print(f'render_docs: {r["name"]}: warning: {w}', file=sys.stderr)
        if r['error']: print(f'render_docs: {r["name"]}: nbdev processing FAILED (page rendered without show_doc output): {r["error"]}', file=sys.stderr)
    if not quiet:
        print(f'render_docs: {len(order)} notebooks -> {out}/ ({", ".join(page_of[n] for n in order)}) in {time.time()-t0:.1f}s')
    return results, failed

def copy_assets(body, nbs, out):
    "Copy local files the page refers to (`src=`/`href=` relative paths that exist under nbs/)."
    for ref in re.findall(r'(?:src|href)="([^"#?:]+)"', body):
        p = (nbs/ref)
        if not ref.endswith(('.html', '.ipynb')) and p.is_file() and nbs.resolve() in p.resolve().parents:
            (out/ref).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(p, out/ref)

# ---------------------------------------------------------------------------------------------- README

def readme_text(nb_path=None):
    "README.md from `nbs/index.ipynb` after nbdev's processors: `# title`, `> description`, markdown cells,"
    " shown code and its text / text/markdown outputs. `X.ipynb` links, and nbdev's links to the doc site's pages,"
    " point to `nbs/X.ipynb`."
    nb_path = Path(nb_path or ROOT/'nbs'/'index.ipynb')
    os.environ.setdefault('MPLBACKEND', 'Agg')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        try: nb = _nbdev_process(nb_path)
        except Exception as e:
            print(f'render_docs: {nb_path.name}: nbdev processing failed ({e}); README without show_doc output', file=sys.stderr)
            nb = _nbdev_process(nb_path, execute=False)
    fm, nb = split_frontmatter(_strip_nb(nb))
    nb = apply_directives(nb)
    parts = [f'# {fm.get("title") or read_settings().get("title", "README")}']
    if fm.get('description'): parts.append(f'> {fm["description"]}')
    for c in nb['cells']:
        src = ''.join(c.get('source', '')).strip('\n')
        if c['cell_type'] == 'markdown':
            if src.strip(): parts.append(src)
            continue
        if c['cell_type'] != 'code': continue
        if src.strip() and not c.get('metadata', {}).get('transient', {}).get('remove_source'):
            parts.append(f'```python\n{src}\n```')
        for o in c.get('outputs', []):
            data = o.get('data', {})
            if o.get('output_type') == 'stream' and o.get('name') == 'stdout': txt = ''.join(o.get('text', ''))
            elif 'text/markdown' in data: parts.append(''.join(data['text/markdown']).strip('\n')); continue
            elif 'text/plain' in data and o.get('output_type') == 'execute_result': txt = ''.join(data['text/plain'])
            else: continue
            txt = re.sub(r'\x1b\[[0-9;]*m', '', txt).rstrip('\n')
            if txt.strip(): parts.append(f'    ' + txt.replace('\n', '\n    '))
    md = '\n\n'.join(parts) + '\n'
    md = re.sub(r'\]\((?:\./)?([^)\s#:/]+)\.ipynb(#[^)\s]*)?\)', r'](nbs/\1.ipynb\2)', md)
    # nbdev's links to names point at the Pages site (`{doc_host}{doc_baseurl}/shift.html#shift_right`): in the README
    # they point at the chapter's notebook instead, which exists wherever the README is read (GitHub, a clone)
    cfg = read_settings()
    doc_url = (cfg.get('doc_host', '') + cfg.get('doc_baseurl', '')).rstrip('/')
    if doc_url:
        chapters = {re.sub(r'^\d+[a-z]?_', '', p.stem) + '.html': p.name for p in list_notebooks(nb_path.parent)}
        def chapter(m): return f'](nbs/{chapters[m.group(1)]})' if m.group(1) in chapters else m.group(0)
        md = re.sub(r'\]\(' + re.escape(doc_url) + r'/([^)\s#/]+\.html)(?:#[^)\s]*)?\)', chapter, md)
    md = re.sub(r'(?m)[ \t]+$', '', md)
    return re.sub(r'\n{3,}', '\n\n', md)

# ---------------------------------------------------------------------------------------------- CLI

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split('\n', 1)[1])
    ap.add_argument('--out', default=None, help='site folder (default: doc_path of settings.ini, _docs)')
    ap.add_argument('--proc', default=None, help='where processed notebooks go (default: _proc/ for the default --out, '
                                                 'none when --out is given)')
    ap.add_argument('--nbs', default=str(ROOT/'nbs'), help='notebook folder (default: nbs/)')
    ap.add_argument('-j', '--jobs', type=int, default=None, help='parallel notebook processes (default: one per notebook, at most 8)')
    ap.add_argument('--readme', nargs='?', const=str(ROOT/'README.md'), default=None, metavar='PATH',
                    help='write README.md (or PATH; "-" for stdout) from nbs/index.ipynb instead of building the site')
    ap.add_argument('--sidebar', action='store_true', help='write nbs/sidebar.yml instead of building the site')
    ap.add_argument('--timeout', type=float, default=180, help='seconds per notebook for nbdev processing (default 180; 0: no limit)')
    ap.add_argument('-q', '--quiet', action='store_true')
    ap.add_argument('--_worker', nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        nb, proc, res = a._worker
        r = process_one((nb, proc or None, str(ROOT)))
        Path(res).write_text(json.dumps(r))
        return 0
    if a.sidebar or a.readme:
        if a.sidebar:
            p = write_sidebar(a.nbs)
            if not a.quiet: print(f'render_docs: wrote {p}', file=sys.stderr)
        if a.readme:
            text = readme_text(Path(a.nbs)/'index.ipynb')
            if a.readme == '-': sys.stdout.write(text)
            else:
                Path(a.readme).write_text(text)
                if not a.quiet: print(f'render_docs: wrote {a.readme}', file=sys.stderr)
        return 0
    settings = read_settings()
    out = Path(a.out) if a.out else ROOT/settings.get('doc_path', '_docs')
    proc = a.proc if a.proc is not None else (None if a.out else ROOT/'_proc')
    if proc:
        proc = Path(proc)
        if proc.exists(): shutil.rmtree(proc)
    _, failed = build_site(out, proc=proc, nbs=a.nbs, n_workers=a.jobs, quiet=a.quiet, timeout=a.timeout)
    if failed:
        print(f'render_docs: {len(failed)} notebook(s) failed nbdev processing: {", ".join(failed)}', file=sys.stderr)
        return 1
    return 0

if __name__ == '__main__':
    sys.exit(main())
