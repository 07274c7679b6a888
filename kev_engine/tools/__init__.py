"""Tools: the engine from a shell — `kev generate`, `kev show-pack` (`visualize`), `kev verify`
(packed == solo, `verify`), `kev build-kernel` (`cli`)."""
