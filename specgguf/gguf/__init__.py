"""The GGUF file format, read without llama.cpp: the metadata reader (:mod:`.metadata`),
vocabularies and their compatibility rules (:mod:`.vocab`), what ``info`` shows
(:mod:`.info`), and the writer of tiny test models (:mod:`.tiny`)."""
