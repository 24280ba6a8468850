// Starts Pyodide from vendor/pyodide and installs the wheels listed in vendor/wheels/manifest.json
// (jinja2, markupsafe, the project wheel), all from this origin: nothing is fetched from elsewhere.
import { loadPyodide } from "./vendor/pyodide/pyodide.mjs";

export async function bootPython(status = () => {}) {
  const t0 = performance.now();
  status("starting Python (Pyodide)…");
  const base = new URL("./vendor/", import.meta.url);
  const pyodide = await loadPyodide({ indexURL: new URL("pyodide/", base).href });
  const manifest = await (await fetch(new URL("wheels/manifest.json", base), { cache: "no-store" })).json();
  for (const name of manifest.wheels) {
    status(`installing ${name}…`);
    await pyodide.loadPackage(new URL("wheels/" + name, base).href, { messageCallback: () => {} });
  }
  status(`Python ready in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
  return pyodide;
}
