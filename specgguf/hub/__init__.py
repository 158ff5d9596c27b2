"""Models on the Hugging Face hub: the registry of aliases and pairs (:mod:`.registry`),
downloads into the standard cache and resolving names to files (:mod:`.download`), PyPI
mirrors (:mod:`.mirror`), and the real test models (:mod:`.testmodels`)."""
