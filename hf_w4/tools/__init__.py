"""The application built on the library: the ``hf-w4`` command line (cli), the embedded default model (models),
checkpoint writers (writers), evaluation (evaluate) and the kernel benchmark (bench). The library never imports
this package."""
