package browser

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A page opened in the tab paints, and its screenshot is saved where
// BGTASK_ARTIFACTS says.
func TestATabPaintsAndIsShot(t *testing.T) {
	path := Chromium(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	tab := OpenTab(t, ctx, path)
	Run(t, tab, chromedp.Navigate(`data:text/html,<!doctype html><h1 style="font-size:200px">bgtask</h1>`))
	assert.Greater(t, Run(t, tab, FirstPaint()), 0.0)
	dir := t.TempDir()
	t.Setenv("BGTASK_ARTIFACTS", dir)
	Shot(t, tab, "page.png")
	info, err := os.Stat(filepath.Join(dir, "page.jpg"))
	require.NoError(t, err, "a full page is saved as a JPEG")
	assert.Greater(t, info.Size(), int64(1000))
}
