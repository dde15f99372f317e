// Drives the trajectory viewer in headless Chromium (playwright-core, Debian's chromium) the
// way a person would: open the printed address, click a session, a call, a trace, hover a
// token. Prints what the page showed as one JSON object; the Rust test asserts on it.
//
//   node page.mjs   with VIEW_URL (…/view/#token=…), SESSION, RECORD, TRACE, SHOTS (a directory)
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE);
const env = (k) => {
  const v = process.env[k];
  if (!v) throw new Error(`${k} is not set`);
  return v;
};
const [url, session, record, trace, shots] = ["VIEW_URL", "SESSION", "RECORD", "TRACE", "SHOTS"].map(env);

const out = { console_errors: [], page_errors: [], failed_requests: [] };
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  // No background traffic: this machine's network is closed and the test talks to loopback only.
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
try {
  const context = await browser.newContext({ viewport: { width: 1360, height: 900 } });
  const page = await context.newPage();
  page.on("console", (m) => { if (m.type() === "error") out.console_errors.push(m.text()); });
  page.on("pageerror", (e) => out.page_errors.push(String(e)));
  page.on("requestfailed", (r) => out.failed_requests.push(r.url()));
  const ready = (prefix) => page.waitForFunction(
    (p) => (document.body.dataset.ready || "").startsWith(p), prefix, { timeout: 20000 });

  // The session list.
  await page.goto(url);
  await ready("/");
  out.address_after_load = page.url();
  out.session_rows = await page.locator("tr.session-row").count();
  await page.screenshot({ path: `${shots}/sessions.png` });

  // One session: its timeline and calls; then a call's request and answer.
  await page.locator(`tr.session-row[data-session="${session}"]`).click();
  await ready("/session/");
  out.call_bars = await page.locator(".call-bar").count();
  out.call_rows = await page.locator("tr.call-row").count();
  out.trace_rows = await page.locator("tr.trace-row").count();
  await page.locator(`.call-bar[data-record="${record}"]`).click();
  await page.locator(".panel.record").waitFor({ timeout: 20000 });
  out.record_panel = await page.locator(".panel.record").innerText();
  out.img_elements = await page.locator("img").count();
  out.script_elements = await page.locator("script").count();
  out.pwned = await page.evaluate(() => window.__pwned === undefined ? null : String(window.__pwned));
  await page.screenshot({ path: `${shots}/session.png`, fullPage: true });

  // One trace: tokens by mask, shaded by logprob; hover names the token.
  await page.locator(`tr.trace-row[data-trace="${trace}"]`).click();
  await ready("/trace/");
  out.sampled_tokens = await page.locator(".tok.s").count();
  out.context_tokens = await page.locator(".tok.c").count();
  out.prompt_tokens = await page.locator(".tok.p").count();
  out.stats_trainable = await page.locator("#trace-stats").getAttribute("data-trainable");
  const first = page.locator(".tok.s").first();
  out.first_sampled = { id: await first.getAttribute("data-id"), text: await first.textContent() };
  await first.hover();
  await page.locator("#hover:not([hidden])").waitFor({ timeout: 5000 });
  out.hover = await page.locator("#hover").innerText();
  await page.screenshot({ path: `${shots}/trace.png` });
  out.img_elements_after = await page.locator("img").count();
  out.pwned_after = await page.evaluate(() => window.__pwned === undefined ? null : String(window.__pwned));

  // A fresh browser without the token sees no data, only how to get in.
  const stranger = await (await browser.newContext()).newPage();
  await stranger.goto(url.replace(/#.*$/, "#/"));
  await stranger.waitForFunction(() => document.body.dataset.ready === "error", null, { timeout: 20000 });
  out.without_token = await stranger.locator("main").innerText();
} finally {
  await browser.close();
}
console.log(JSON.stringify(out));
