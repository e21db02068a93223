# Regenerates jinja_reference_cases.jsonl: each line is [name, template, context, jinja2 output]
# rendered with the environment transformers builds (run: python3 make_jinja_reference_cases.py > jinja_reference_cases.jsonl).
import json
from transformers.utils.chat_template_utils import _compile_jinja_template
cases = [
 ("ws", "{% if true %}\n  yes\n{% endif %}\n  {%- if true -%}  x  {%- endif %}\n{# c #}\nend", {}),
 ("lstrip", "a\n    {% if true %}b{% endif %}\n  {{ 'c' }}\n", {}),
 ("loop", "{% for x in items if x != 'skip' %}{{ loop.index }}/{{ loop.length }}:{{ x }}{% if loop.first %}F{% endif %}{% if loop.last %}L{% endif %}{% if loop.previtem is defined %}<{{ loop.previtem }}{% endif %}|{% else %}none{% endfor %}", {"items": ["a", "skip", "b", "c"]}),
 ("loop_else", "{% for x in [] %}x{% else %}empty{% endfor %}", {}),
 ("scope", "{% set x = 1 %}{% for i in range(3) %}{% set x = i %}{% endfor %}{{ x }}", {}),
 ("ns", "{% set ns = namespace(n=0) %}{% for i in range(4) %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}", {}),
 ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bob') }} {{ greet('Al', punct='?') }}", {}),
 ("tojson", "{{ obj | tojson }}|{{ obj | tojson(indent=2) }}", {"obj": {"b": [1, 2.5, None, True], "a": "é\"\n", "c": {}}}),
 ("string_repr", "{{ obj | string }}|{{ [1, 'a', None, 1.0] }}", {"obj": {"k": "it's", "n": [True, 1e20]}}),
 ("methods", "{{ s.split(',') }}|{{ s.strip() }}|{{ s.upper() }}|{{ s.startswith(' a') }}|{{ s.replace('b', 'B') }}|{{ s[::-1] }}|{{ s[1:3] }}|{{ 'x y  z'.split() }}|{{ s.rstrip(' ').lstrip() }}", {"s": " a,b,c "}),
 ("filters", "{{ xs | join('-') }}|{{ xs | length }}|{{ '  t  ' | trim }}|{{ xs | first }}|{{ xs | last }}|{{ d | items | list }}|{{ xs | reject('in', ['b']) | list }}|{{ ms | selectattr('role', 'equalto', 'user') | map(attribute='c') | join }}|{{ undefined_var | default('dflt') }}|{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ 7 / 2 }}", {"xs": ["a", "b", "c"], "d": {"x": 1, "y": 2}, "ms": [{"role": "user", "c": "1"}, {"role": "bot", "c": "2"}, {"role": "user", "c": "3"}]}),
 ("tests", "{{ x is defined }}{{ y is defined }}{{ none is none }}{{ 's' is string }}{{ d is mapping }}{{ xs is iterable }}{{ 3 is odd }}{{ x is number }}{{ true is true }}", {"x": 3, "d": {}, "xs": []}),
 ("cond", "{{ 'a' if x else 'b' }}{{ 'c' if not x }}{{ x and 'y' }}{{ x or 'z' }}", {"x": 0}),
 ("concat", "{{ 1 ~ 'a' ~ none ~ true }}{{ 'ab' * 3 }}{{ [1] + [2] }}", {}),
 ("dict_get", "{{ d.get('a') }} {{ d.get('z', 'none!') }} {{ d['a'] }} {{ d.a }} {{ d.missing is defined }}", {"d": {"a": 1}}),
 ("floats", "{{ 0.1 + 0.2 }} {{ 1e16 }} {{ 1.5e-05 }} {{ 100.0 }} {{ 2.0 ** 0.5 }} {{ 1/3 }}", {}),
 ("break", "{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}", {}),
 ("whitespace_minus_var", "a  {{- ' b ' -}}  c", {}),
 ("raw_newline_end", "line\n", {}),
 ("set_block", "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]", {}),
]
for name, src, ctx in cases:
    try:
        out = _compile_jinja_template(src).render(**ctx)
    except Exception as e:
        out = "ERROR " + type(e).__name__ + ": " + str(e)
    print(json.dumps([name, src, ctx, out], ensure_ascii=False))
