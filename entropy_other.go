//go:build !unix

package bgtask

import "crypto/rand"

// osEntropy fills b from the system's entropy (crypto/rand where there is
// no /dev/urandom).
func osEntropy(b []byte) error {
	_, err := rand.Read(b)
	return err
}
