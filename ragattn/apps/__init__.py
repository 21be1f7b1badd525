"""ragattn's applications: the ``python -m ragattn <command>`` tools, on top of the library.

* :mod:`.cli`: what every command shares (one ``error:`` line and exit status 2, argument and
  output-path checks, results never lost to a failed write);
* :mod:`.demo` (``demo``), :mod:`.eval` (``eval``), :mod:`.build_store` (``build-store``),
  :mod:`.check_model` (``check-model``, the quality gate of ``ragattn.methods.quality_gate``),
  :mod:`.finetune` (``finetune``), :mod:`.refrag_train` (``refrag-train``);
* :mod:`.corpus` (the shipped QA passages and questions, the answer metrics) and :mod:`.long_qa`
  (a long-context QA set built from them), the data the commands run on.

The library (ops, store, hf, methods, engines) never imports this package
(tests/tooling/test_kernel_layering.py); ``ragattn/__main__.py`` dispatches the commands here.
"""
