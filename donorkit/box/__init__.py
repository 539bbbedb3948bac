"""What runs on a box through pyinfra: facts, operations, the kernel and wheel caches, the tunnel's
operations, serving; and the pyinfra inventory groups. Imports render/ and inventory/."""
