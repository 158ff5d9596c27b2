"""specgguf's version, in a module of its own: any layer may read it without importing the
package's lazy exports."""

__version__ = "0.1.0"
