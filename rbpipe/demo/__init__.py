"""The demo's model and task, the defaults of ``rbpipe run``: :mod:`rbpipe.demo.policy` (the tiny Qwen2
policy built from a config in code, its tokenizer and sampling loop) and :mod:`rbpipe.demo.task` (the
built-in copy-the-first-digit task, ``--task rbpipe.demo.task:CopyFirstDigitTask``)."""
