"""The compiler side: the step runner and its graph modes, AOTInductor packages, the frozen-weight
store, background compile and its worker, every change to torch."""
