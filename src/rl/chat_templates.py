"""The tiny models' chat templates (rl/tiny_model.py): each renders as its family's renderer in verifiers'
`renderers` does, token for token, so SFT (which renders with the template) and RL (which renders with the
renderer) put the same tokens before the model.

- QWEN3: Qwen3's, shortened (no thinking blocks); without tools it renders plain ChatML, tools as Qwen3 offers them
  (`# Tools`, `<tools>` JSON) and calls as `<tool_call>` JSON. The `default` renderer with Qwen3's tool parser
  reads it.
- QWEN3_5: Qwen3.5's format, written from the `qwen3.5` renderer's behaviour (renderers/qwen35.py): calls as XML
  (`<function=name>`, one `<parameter=k>` each), a `<think>` block on the assistant turns after the last user query,
  images as `<|vision_start|><|image_pad|><|vision_end|>` (the processor widens the pad), and `enable_thinking`
  off by default as on Qwen3.5's small checkpoints (the prompt ends with an empty think block). With thinking off it
  keeps the empty think block on earlier turns, as the renderer does, so a conversation's tokens do not change when
  it is rendered again.
"""

QWEN3 = """\
{%- macro turn(role, content) %}{{- '<|im_start|>' + role + '\n' + content + '<|im_end|>\n' }}{%- endmacro %}
{%- if tools %}
{%- set head = messages[0]['content'] + '\n\n' if messages and messages[0]['role'] == 'system' else '' %}
{{- '<|im_start|>system\n' + head
    + '# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
    + '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    + '</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' and loop.first and tools %}
{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}
{{- '<|im_start|>assistant\n' + (message['content'] or '') }}
{%- for call in message['tool_calls'] %}
{%- set call = call['function'] if call.get('function') else call %}
{%- set arguments = call['arguments'] if call['arguments'] is string else call['arguments'] | tojson %}
{{- ('\n' if message['content'] or not loop.first else '')
    + '<tool_call>\n{"name": "' + call['name'] + '", "arguments": ' + arguments + '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- else %}
{{- turn(message['role'], message['content'] or '') }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
"""

QWEN3_5_TOOL_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified "
    "format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in "
    "natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer "
    "the question like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>"
)

QWEN3_5 = """\
{%- macro render(content) %}
{%- if content is string %}{{- content }}
{%- elif content %}{%- for part in content %}
{%- if part is string %}{{- part }}
{%- elif part.type in ('image', 'image_url') %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- elif part.text is defined %}{{- part.text }}
{%- endif %}{%- endfor %}
{%- endif %}
{%- endmacro %}
{%- set thinking = enable_thinking if enable_thinking is defined else false %}
{%- set system = render(messages[0].content) | trim if messages[0].role == 'system' else '' %}
{%- if tools %}
{{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
{{- '\n</tools>' + TOOL_INSTRUCTIONS + ('\n\n' + system if system else '') + '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + system + '<|im_end|>\n' }}
{%- endif %}
{%- set last = namespace(query=messages | length) %}
{%- for message in messages %}
{%- set content = render(message.content) | trim %}
{%- set wraps_a_tool_response = content.startswith('<tool_response>') and content.endswith('</tool_response>') %}
{%- if message.role == 'user' and not wraps_a_tool_response %}{%- set last.query = loop.index0 %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = render(message.content) | trim %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
{%- if message.reasoning_content is not string and '</think>' in content %}
{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].lstrip('\n').rstrip('\n') %}
{%- set content = content.split('</think>', 1)[1].lstrip('\n') %}
{%- endif %}
{%- set reasoning = reasoning | trim %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > last.query or (not thinking and not reasoning) %}
{{- '<think>\n' + reasoning + '\n</think>\n\n' + content }}
{%- else %}{{- content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set call = call.function if call.function is defined else call %}
{{- ('\n\n' if content | trim else '') if loop.first else '\n' }}
{{- '<tool_call>\n<function=' + call.name + '>\n' }}
{%- if call.arguments is mapping %}{%- for name, value in call.arguments.items() %}
{%- set value = value | tojson if value is mapping or (value is sequence and value is not string) else value | string %}
{{- '<parameter=' + name + '>\n' + value + '\n</parameter>\n' }}
{%- endfor %}{%- endif %}
{{- '</function>\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n<think>\n' + ('' if thinking else '\n</think>\n\n') }}
{%- endif %}
""".replace("TOOL_INSTRUCTIONS", f"'{QWEN3_5_TOOL_INSTRUCTIONS}'")  # a Jinja string: the text holds no quote
