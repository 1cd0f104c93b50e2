"""What a chat template reads, found in its syntax tree once at load: whether it loops over a
message's content (and so takes it as a list of parts), and which variables a request may give
it (`CHAT_TEMPLATE_KWARGS`)."""

from __future__ import annotations

import jinja2
from jinja2 import meta, nodes

SERVER_SET_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message"})
"""Set from the request's own inputs: the same keys in CHAT_TEMPLATE_KWARGS are dropped, as
vLLM lets the request's fields win."""
REFUSED_VARIABLES = frozenset({"chat_template", "tokenize"})
"""`apply_chat_template`'s own arguments, which vLLM refuses in `chat_template_kwargs` too."""


def _tree(template: object) -> nodes.Template | None:
    if not isinstance(template, str):
        return None
    try:
        return jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return None  # applying it will say what is wrong


def _unwrap(node: nodes.Node) -> nodes.Node:
    """`x | filter(...)` and `x[1:]` read as `x`."""
    while True:
        inner = getattr(node, "node", None)
        filtered = isinstance(node, nodes.Filter)
        sliced = isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)
        if inner is None or not (filtered or sliced):
            return node
        node = inner


def _content_owner(node: nodes.Node) -> nodes.Node | None:
    """`x` of `x.content` or `x['content']`, else None."""
    if isinstance(node, nodes.Getattr) and node.attr == "content":
        return node.node
    if isinstance(node, nodes.Getitem) and getattr(node.arg, "value", None) == "content":
        return node.node
    return None


def _names(node: nodes.Node) -> set[str]:
    return {node.name} if isinstance(node, nodes.Name) else set()


def reads_content_parts(template: object) -> bool:
    """Whether the template loops over a message's content (`{% for message in messages %}
    ... {% for part in message['content'] %}`), and so needs it as a list of parts: vLLM's
    "openai" content format, detected as vLLM does (`_detect_content_format`): a message is a
    loop variable over `messages` (or a slice or a `set` copy of it), or a `set` of one item of
    it. Else content is one string."""
    tree = _tree(template)
    if tree is None:
        return False
    lists, messages = {"messages"}, set()
    assigns, loops = list(tree.find_all(nodes.Assign)), list(tree.find_all(nodes.For))
    for _ in range(len(assigns) + 1):  # `set` copies of copies, to a fixed point
        for assign in assigns:
            source = _unwrap(assign.node)
            if isinstance(source, nodes.Name) and source.name in lists:
                lists |= _names(assign.target)
            elif isinstance(source, nodes.Getitem) and _names(source.node) & lists:
                messages |= _names(assign.target)
    for loop in loops:
        if _names(_unwrap(loop.iter)) & lists:
            messages |= _names(loop.target)
    owners = (_content_owner(_unwrap(loop.iter)) for loop in loops)
    return any(owner is not None and _names(owner) & messages for owner in owners)


def template_variables(template: object) -> frozenset[str]:
    """The variables the template reads that it does not set itself (`enable_thinking`, ...):
    what CHAT_TEMPLATE_KWARGS may give it."""
    tree = _tree(template)
    return frozenset() if tree is None else frozenset(meta.find_undeclared_variables(tree))
