"""BPF programs (``*.bpf.c`` + shared ``*.h``) and the one bcc loader module (:mod:`llmdiag.bpf.loader`)."""
