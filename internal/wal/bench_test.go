package wal_test

import (
	"bytes"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bgtask/bgtask/internal/wal"
)

// BenchmarkGroupCommit: 32 writers, each appending a batch of three
// 150-byte records and waiting for it, b.N batches in all; with
// preallocation (rounds overwrite durable zeros, fdatasync commits no
// metadata) and without (rounds append). It reports batches/s, the wall
// time of a round (a write and its sync: rounds run one at a time) and
// how many batches a round carried.
func BenchmarkGroupCommit(b *testing.B) {
	const writers = 32
	batch := [][]byte{bytes.Repeat([]byte("a"), 150), bytes.Repeat([]byte("b"), 150), bytes.Repeat([]byte("c"), 150)}
	for _, lay := range layouts {
		b.Run(lay.name, func(b *testing.B) {
			fs := &faultFS{} // no hooks: it counts the syncs of rounds
			l, err := wal.Open(b.TempDir(), wal.Options{FS: fs, NoPrealloc: !lay.prealloc})
			if err != nil {
				b.Fatal(err)
			}
			defer l.Close()
			var next atomic.Int64
			var wg sync.WaitGroup
			rounds0 := fs.dataSyncCount()
			b.ResetTimer()
			start := time.Now()
			for range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for next.Add(1) <= int64(b.N) {
						if err := l.Append(batch).Wait(); err != nil {
							b.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			b.StopTimer()
			rounds := fs.dataSyncCount() - rounds0
			b.ReportMetric(float64(b.N)/elapsed.Seconds(), "batches/s")
			b.ReportMetric(float64(elapsed.Nanoseconds())/float64(max(rounds, 1)), "ns/round")
			b.ReportMetric(float64(b.N)/float64(max(rounds, 1)), "batches/round")
		})
	}
}
