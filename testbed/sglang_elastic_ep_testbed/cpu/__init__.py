"""CPU engine support: torch versions of what SGLang's CPU path needs, active only on CPU."""
