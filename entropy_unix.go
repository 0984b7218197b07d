//go:build unix

package bgtask

import (
	"io"
	"os"
)

// osEntropy fills b from the system's entropy (/dev/urandom), as
// crypto/rand does on these systems, without linking crypto/rand's
// generator into every importer: only the seed of the id generator is
// read here, once per Manager.
func osEntropy(b []byte) error {
	f, err := os.Open("/dev/urandom")
	if err != nil {
		return err
	}
	defer f.Close()
	_, err = io.ReadFull(f, b)
	return err
}
