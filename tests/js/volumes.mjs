// The e2b JS SDK (npm) against a Strata node: a volume written through the
// volume API and mounted in a sandbox, a file the guest writes read back
// through the API, a snapshot started as a template (its mount with it),
// then the snapshot and the volume deleted. Prints one JSON line of what it
// saw; tests/test_api_volumes.py checks it. E2B_API_URL, E2B_SANDBOX_URL,
// E2B_VOLUME_API_URL and E2B_API_KEY come from the environment.
import { Sandbox, Volume } from 'e2b'

const seen = {}
const vol = await Volume.create('js-data')
try {
  await vol.writeFile('/seed.txt', 'from the JS API\n')
  const sbx = await Sandbox.create('base', { timeoutMs: 300_000, volumeMounts: { '/mnt/data': vol } })
  try {
    seen.seed = (await sbx.commands.run('cat /mnt/data/seed.txt')).stdout
    await sbx.commands.run('mkdir -p /mnt/data/out && echo from-js-guest > /mnt/data/out/g.txt')
    seen.guest = await vol.readFile('/out/g.txt')
    const snap = await sbx.createSnapshot()
    const child = await Sandbox.create(snap.snapshotId, { timeoutMs: 120_000 })
    seen.child = (await child.commands.run('cat /mnt/data/out/g.txt')).stdout
    await child.kill()
    seen.deleted = await Sandbox.deleteSnapshot(snap.snapshotId)
    seen.deletedAgain = await Sandbox.deleteSnapshot(snap.snapshotId)
  } finally {
    await sbx.kill()
  }
} finally {
  seen.destroyed = await Volume.destroy(vol.volumeId)
}
console.log(JSON.stringify(seen))
