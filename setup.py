# nbdev's setup.py template without `pkg_resources` (gone from current setuptools).
from configparser import ConfigParser
import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini')
cfg = cfg['DEFAULT']

expected = 'version description keywords author author_email'.split()
for o in expected: assert o in cfg, f"missing expected setting: {o}"

licenses = {'apache2': 'Apache-2.0'}  # SPDX expression (license classifiers are deprecated)
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
py_versions = '3.9 3.10 3.11 3.12 3.13'.split()

requirements = cfg.get('requirements', '').split()
dev_requirements = cfg.get('dev_requirements', '').split()
min_python = cfg['min_python']
lic = licenses[cfg['license']]

setuptools.setup(
    name=cfg['lib_name'],
    license=lic,
    classifiers=['Development Status :: ' + statuses[int(cfg['status'])],
                 'Intended Audience :: ' + cfg['audience'].title(),
                 'Natural Language :: ' + cfg['language'].title()]
                + ['Programming Language :: Python :: ' + o for o in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    packages=setuptools.find_packages(include=['relpos', 'relpos.*']),
    include_package_data=True,
    install_requires=requirements,
    extras_require={'dev': dev_requirements, 'faiss': ['faiss-cpu']},  # pip install relpos[faiss]: approximate kNN search
    python_requires='>=' + min_python,
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'nbdev': [f'{cfg["lib_path"]}={cfg["lib_path"]}._modidx:d']},
    version=cfg['version'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    description=cfg['description'],
    keywords=cfg['keywords'],
)
