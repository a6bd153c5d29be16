"""`zerotune doctor`: what a DeepSpeed setup needs, checked on this machine, each problem with its fix."""
