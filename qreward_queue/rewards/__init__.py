"""Built-in CPU rewards, usable as `function` backends."""
